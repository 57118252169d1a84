"""Packed (THD) micro-batches for the megatron trainer.

A packed micro-batch concatenates its samples' tokens without padding (under context
parallelism each sample is padded at its end to a multiple of 2*cp); attention stays
inside each sample through cu_seqlens (roles.trainer.megatron.attention), and positions
restart at 0 per sample. Response-aligned inputs and outputs keep the [n, Rm] layout of
roles.trainer.batching.MicroBatch, so the PPO and value losses of algorithms apply
unchanged.

With --use-dynamic-batch-size a micro-batch costs the SUM of its samples' lengths (no
padding), so `plan_packed` fills micro-batches up to max_tokens_per_gpu by that sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roles.trainer.batching import valid_mask


def plan_packed(lengths: list[int], *, micro_batch_size: int | None = None,
                max_tokens: int | None = None) -> list[list[int]]:
    """Group positions 0..len(lengths)-1 into micro-batches; exactly one limit is set.

    max_tokens: first-fit over lengths sorted longest first, a micro-batch costing the sum
    of its lengths; a sample longer than max_tokens gets a micro-batch of its own.
    """
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("set exactly one of micro_batch_size and max_tokens")
    if micro_batch_size is not None:
        return [list(range(s, min(s + micro_batch_size, len(lengths)))) for s in range(0, len(lengths), micro_batch_size)]
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                groups[g].append(i)
                loads[g] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    return [sorted(g) for g in groups]


@dataclass(kw_only=True)
class PackedMicroBatch:
    indices: list[int]  # positions of these samples in the batch
    input_ids: torch.Tensor  # [T] the samples' tokens, concatenated
    position_ids: torch.Tensor  # [T] restarting at 0 per sample
    cu_seqlens: torch.Tensor  # int32 [n + 1]
    prompt_lens: torch.Tensor  # [n]
    response_lens: torch.Tensor  # [n]
    response: dict[str, torch.Tensor]  # response-aligned inputs, [n, Rm]
    rows: torch.Tensor  # [Nr] packed positions whose next token is a response token
    targets: torch.Tensor  # [Nr] those response tokens
    row_sample: torch.Tensor  # [Nr] sample of each row (0..n-1)
    row_offset: torch.Tensor  # [Nr] response position of each row (0..Rm-1)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    @property
    def response_width(self) -> int:
        return int(self.response_lens.max())

    @property
    def valid(self) -> torch.Tensor:
        """bool [n, Rm]: tokens that count in the loss (needs "loss_mask" in response)."""
        return valid_mask(self.response["loss_mask"], self.response_lens)

    def to_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """[Nr] per-row results -> [n, Rm] (zero past each response); differentiable."""
        out = flat.new_zeros(len(self.indices), self.response_width)
        return out.index_put((self.row_sample.to(flat.device), self.row_offset.to(flat.device)), flat)


def pack(seqs: list[torch.Tensor], batch: dict, indices: list[int], response_keys: tuple[str, ...],
         pad_multiple: int = 1) -> PackedMicroBatch:
    """The samples at `indices` as one packed micro-batch (seqs: roles.trainer.batching.sequences).

    pad_multiple: each sample is padded at its end (token 0) to a multiple of it; context
    parallelism needs 2*cp (roles.trainer.megatron.cp). Padding comes after every real
    token of its sample, so under causal attention it changes nothing they compute.
    """
    rows_ids = [torch.cat([seqs[i], seqs[i].new_zeros(-len(seqs[i]) % pad_multiple)]) for i in indices]
    lengths = torch.tensor([len(r) for r in rows_ids])
    idx = torch.tensor(indices)
    prompt_lens = batch["prompt_lens"][idx].long()
    response_lens = batch["response_lens"][idx].long()
    starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    row_sample = torch.repeat_interleave(torch.arange(len(indices)), response_lens)
    row_offset = torch.cat([torch.arange(int(r)) for r in response_lens])
    # response token r of sample i is predicted at its position prompt_len + r - 1
    rows = starts[row_sample] + prompt_lens[row_sample] - 1 + row_offset
    input_ids = torch.cat(rows_ids)
    rm = int(response_lens.max())
    return PackedMicroBatch(
        indices=indices,
        input_ids=input_ids,
        position_ids=torch.cat([torch.arange(int(n)) for n in lengths]),
        cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(torch.int32),
        prompt_lens=prompt_lens,
        response_lens=response_lens,
        response={k: batch[k][idx, :rm] for k in response_keys if batch.get(k) is not None},
        rows=rows,
        targets=input_ids[rows + 1],
        row_sample=row_sample,
        row_offset=row_offset,
    )
