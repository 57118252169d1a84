"""The trainer-side batch schema, mini-batch split and micro-batch planning.

A batch is a dict of CPU tensors that the driver builds; N samples, R = max(response_lens):

    input_ids      int64 [N, L]  each row: prompt tokens, then response tokens, then any
                                 padding (right-padded; pad values are never read), or
                   int64 [S]     packed: the samples' tokens concatenated without padding,
                                 S = sum(prompt_lens + response_lens)
    prompt_lens    int64 [N]     >= 1 (the first response token is predicted from the prompt)
    response_lens  int64 [N]     >= 1
    loss_mask      [N, R]        1 where a response token counts in the loss
    sessions       int64 [N]     optional, train: rows with one id are one agent session's
                                 records (consecutive); global_batch_size counts sessions
    old_log_probs  float [N, R]  actor train: log-probs under the policy that sampled
    ref_log_probs  float [N, R]  actor train, only when use_kl_loss
    advantages     float [N, R]  actor train
    returns        float [N, R]  critic train
    old_values     float [N, R]  critic train

Response-aligned tensors ([N, R]) hold response token r of sample i at [i, r]; entries at
r >= response_lens[i] are padding and are masked out whatever loss_mask holds there.
Endpoint outputs (log_probs, values) use the same layout, float32, zero at padding.

Inside a micro-batch the samples are right-padded to the longest one and an attention
mask hides the padding. True packing (all samples in one row, attention kept per sample
with cu_seqlens) would avoid the padded compute, but needs a varlen attention kernel
(flash-attn) that this backend does not depend on; `plan_micro_batches` costs a
micro-batch by its padded size, and `collate` is the single place to change for packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SEQUENCE_KEYS = ("input_ids", "prompt_lens", "response_lens")
ACTOR_TRAIN_KEYS = ("loss_mask", "old_log_probs", "advantages")
CRITIC_TRAIN_KEYS = ("loss_mask", "old_values", "returns")


def check_batch(batch: dict, required: tuple[str, ...]) -> int:
    """Validate the keys and shapes named in `required` (plus the sequence keys); return N."""
    missing = [k for k in SEQUENCE_KEYS + required if k not in batch]
    if missing:
        raise ValueError(f"batch is missing {missing}; it has {sorted(batch)}")
    prompt_lens, response_lens = batch["prompt_lens"], batch["response_lens"]
    if prompt_lens.dim() != 1 or prompt_lens.shape != response_lens.shape:
        raise ValueError(
            f"prompt_lens {tuple(prompt_lens.shape)} and response_lens {tuple(response_lens.shape)} "
            "must both be [N]"
        )
    n = prompt_lens.numel()
    if n == 0:
        raise ValueError("batch has no samples")
    if int(prompt_lens.min()) < 1 or int(response_lens.min()) < 1:
        raise ValueError("every sample needs prompt_lens >= 1 and response_lens >= 1")
    total = prompt_lens + response_lens
    ids = batch["input_ids"]
    if ids.dim() == 2:
        if ids.shape[0] != n or ids.shape[1] < int(total.max()):
            raise ValueError(
                f"input_ids {tuple(ids.shape)} must be [N={n}, L >= {int(total.max())}] "
                "(prompt + response of the longest sample)"
            )
    elif ids.dim() == 1:
        if ids.numel() != int(total.sum()):
            raise ValueError(
                f"packed input_ids has {ids.numel()} tokens, expected sum(prompt_lens + response_lens)"
                f"={int(total.sum())}"
            )
    else:
        raise ValueError(f"input_ids must be [N, L] or packed [S], got shape {tuple(ids.shape)}")
    r = int(response_lens.max())
    for key in required:
        if batch[key].dim() != 2 or batch[key].shape[0] != n or batch[key].shape[1] < r:
            raise ValueError(f"{key} has shape {tuple(batch[key].shape)}, expected [N={n}, R={r}]")
    return n


def sequences(batch: dict) -> list[torch.Tensor]:
    """Per-sample token ids (prompt + response, no padding), from padded or packed input_ids."""
    total = (batch["prompt_lens"] + batch["response_lens"]).tolist()
    ids = batch["input_ids"].long()
    if ids.dim() == 1:
        return list(torch.split(ids, total))
    return [ids[i, :t] for i, t in enumerate(total)]


def response_mask(response_lens: torch.Tensor, width: int) -> torch.Tensor:
    """bool [N, width]: True at r < response_lens[i]."""
    return torch.arange(width).unsqueeze(0) < response_lens.unsqueeze(1)


def valid_mask(loss_mask: torch.Tensor, response_lens: torch.Tensor) -> torch.Tensor:
    """bool [N, R]: response tokens that count in the loss (loss_mask on, inside the response)."""
    return (loss_mask != 0) & response_mask(response_lens, loss_mask.shape[1])


def split_mini_batches(num_samples: int, global_batch_size: int, sessions: torch.Tensor | None = None
                       ) -> list[list[int]]:
    """Consecutive sample indices for each optimizer step. global_batch_size counts rows, or
    with `sessions` ([N] int, non-decreasing: the rows of one agent session, its records, are
    consecutive; docs/agents.md) it counts sessions, whose rows stay in one mini-batch, so a
    rollout's number of optimizer steps does not depend on how many records its sessions made.
    That count must be a multiple of the size."""
    if sessions is None:
        sessions = torch.arange(num_samples)
    elif sessions.shape != (num_samples,) or bool((sessions[1:] < sessions[:-1]).any()):
        raise ValueError(f"sessions must be [N={num_samples}] and non-decreasing, got {sessions.tolist()}")
    _, ordinal = torch.unique_consecutive(sessions, return_inverse=True)
    num_sessions = int(ordinal[-1]) + 1 if num_samples else 0
    if num_sessions % global_batch_size != 0:
        raise ValueError(
            f"train batch has {num_sessions} samples, not a multiple of global_batch_size="
            f"{global_batch_size}; make rollout_batch_size * n_samples_per_prompt a multiple of it"
        )
    minis: list[list[int]] = [[] for _ in range(num_sessions // global_batch_size)]
    for i, k in enumerate((ordinal // global_batch_size).tolist()):
        minis[k].append(i)
    return minis


def plan_micro_batches(
    lengths: list[int],
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
) -> list[list[int]]:
    """Group positions 0..len(lengths)-1 into micro-batches; exactly one of the limits is set.

    micro_batch_size: consecutive groups of that many samples.
    max_tokens: first-fit over lengths sorted longest first, a micro-batch costing
    (samples x longest sample) tokens because it is padded. A sample longer than
    max_tokens gets a micro-batch of its own. Each group lists positions, so results
    map back to sample order.
    """
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("set exactly one of micro_batch_size and max_tokens")
    if micro_batch_size is not None:
        return [
            list(range(start, min(start + micro_batch_size, len(lengths))))
            for start in range(0, len(lengths), micro_batch_size)
        ]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        for group in groups:
            # The group's first member is its longest (descending order), so it sets the padding.
            if (len(group) + 1) * lengths[group[0]] <= max_tokens:
                group.append(i)
                break
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


@dataclass(kw_only=True)
class MicroBatch:
    """A padded slice of a batch, ready for the model."""

    indices: list[int]  # positions of these samples in the batch
    input_ids: torch.Tensor  # [n, Lm] right-padded with 0
    attention_mask: torch.Tensor  # [n, Lm] 1 on real tokens
    prompt_lens: torch.Tensor  # [n]
    response_lens: torch.Tensor  # [n]
    response: dict[str, torch.Tensor]  # response-aligned inputs, [n, Rm], Rm = max response len here

    @property
    def response_width(self) -> int:
        return int(self.response_lens.max())

    @property
    def valid(self) -> torch.Tensor:
        """bool [n, Rm]: tokens that count in the loss (needs "loss_mask" in response)."""
        return valid_mask(self.response["loss_mask"], self.response_lens)


def collate(
    seqs: list[torch.Tensor], batch: dict, indices: list[int], response_keys: tuple[str, ...]
) -> MicroBatch:
    """Pad the samples at `indices` into one micro-batch (see the module note on packing)."""
    rows = [seqs[i] for i in indices]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for j, row in enumerate(rows):
        input_ids[j, : len(row)] = row
        attention_mask[j, : len(row)] = 1
    idx = torch.tensor(indices)
    response_lens = batch["response_lens"][idx].long()
    rm = int(response_lens.max())
    return MicroBatch(
        indices=indices,
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_lens=batch["prompt_lens"][idx].long(),
        response_lens=response_lens,
        response={k: batch[k][idx, :rm] for k in response_keys if batch.get(k) is not None},
    )


def scatter_rows(parts: list[tuple[list[int], torch.Tensor]], num_samples: int, width: int) -> torch.Tensor:
    """Reassemble per-micro-batch [n, Rm] float results into [N, width] in sample order."""
    out = torch.zeros(num_samples, width, dtype=torch.float32)
    for indices, values in parts:
        out[torch.tensor(indices), : values.shape[1]] = values.float()
    return out
