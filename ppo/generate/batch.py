"""The rollout batch: samples turned into the tensors the trainers read.

Layout (N samples, R = longest response, L = longest prompt + response), all CPU tensors;
see roles.trainer.batching for the trainer side of the same schema:

    input_ids          int64 [N, L]  prompt, response, then padding
    prompt_lens        int64 [N]
    response_lens      int64 [N]
    loss_mask          float [N, R]  1 on response tokens that count: the sample's "loss_mask" where it
                                     has one (a multi-turn trajectory: 0 on tool/environment tokens,
                                     ppo.generate.trajectory), else every response token
    rollout_log_probs  float [N, R]  the engine's log-probs of the sampled tokens (0 where masked)
    scores             float [N]     outcome rewards
    sessions           int64 [N]     only when the samples carry "session" (a generate function's rollout):
                                     0, 1, ... per session, rows with one id are one sampled response's
                                     (an agent session's records: ppo.generate.sessions)
    weight_versions    int64 [N, R]  only when the samples carry them (a partial rollout): the weight
                                     version that sampled each token (0 where padded)
    ... and, added by the loop: old_log_probs, ref_log_probs, values/old_values,
    advantages, returns (all [N, R])
"""

from __future__ import annotations

import torch

from ppo.generate.sessions import session_ordinals


def build_batch(samples: list[dict], pad_id: int) -> dict:
    n = len(samples)
    prompt_lens = torch.tensor([len(s["prompt_ids"]) for s in samples], dtype=torch.int64)
    response_lens = torch.tensor([len(s["response_ids"]) for s in samples], dtype=torch.int64)
    width, r = int((prompt_lens + response_lens).max()), int(response_lens.max())
    input_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    rollout_log_probs = torch.zeros(n, r)
    loss_mask = torch.zeros(n, r)
    for i, s in enumerate(samples):
        seq = s["prompt_ids"] + s["response_ids"]
        input_ids[i, :len(seq)] = torch.tensor(seq)
        m = len(s["response_ids"])
        rollout_log_probs[i, :m] = torch.tensor(s["rollout_log_probs"])
        loss_mask[i, :m] = torch.tensor(s["loss_mask"], dtype=loss_mask.dtype) if "loss_mask" in s else 1.0
    batch = {"input_ids": input_ids, "prompt_lens": prompt_lens, "response_lens": response_lens,
             "loss_mask": loss_mask, "rollout_log_probs": rollout_log_probs,
             "scores": torch.tensor([float(s["reward"]) for s in samples])}
    if any("session" in s for s in samples):  # a generate function's rollout (ppo.generate.trajectories)
        batch["sessions"] = torch.tensor(session_ordinals(samples), dtype=torch.int64)
    if any("weight_versions" in s for s in samples):  # a sample without them (a stale group made again) has one
        batch["weight_versions"] = torch.zeros(n, r, dtype=torch.int64)
        for i, s in enumerate(samples):
            m = len(s["response_ids"])
            batch["weight_versions"][i, :m] = torch.tensor(s.get("weight_versions", [s["weight_version"]] * m))
    return batch


TRAINER_KEYS = ("input_ids", "prompt_lens", "response_lens", "loss_mask")
# where the batch has them: the trainers' mini-batches count sessions (roles.trainer.batching)
OPTIONAL_TRAINER_KEYS = ("sessions",)


def select(batch: dict, *keys: str) -> dict:
    """The sequence keys plus `keys`: send each role only what it reads."""
    return {k: batch[k] for k in TRAINER_KEYS + keys + tuple(k for k in OPTIONAL_TRAINER_KEYS if k in batch)}
