"""Off-policy tokens of partial rollouts: a resumed sample's earlier segments were sampled by older weights.

A partial rollout (ppo.generate.partial) continues unfinished samples in a later rollout, so one
response holds segments sampled by different weight versions. `weight_versions` [B, T] names the
version that sampled each token; `version` is the policy the trainer computes the old log-probs
with (in a synchronous step, the version that sampled the fresh tokens). A token's lag is
version - its weight version: 0 on-policy, > 0 for a segment carried from an earlier rollout.

The correction itself needs no versions: the engine's log-prob of a carried token is its old
policy's, so the TIS weight pi_train / pi_rollout of algorithms.mismatch is already the
per-token importance ratio to the policy that sampled it (miles' off-policy correction, which
tests/test_algorithms_partial.py holds to a float64 per-segment reference). The versions say
how much of a batch is off-policy and by how far.
"""

from __future__ import annotations

import torch

from algorithms._tensors import valid_tokens


def version_lag(weight_versions: torch.Tensor, mask: torch.Tensor, version: int) -> torch.Tensor:
    """[B, T] int64: version - weight_versions on valid tokens, 0 elsewhere. A valid token from a
    version newer than `version` is a ValueError (the driver's bookkeeping is wrong)."""
    valid = valid_tokens(mask, weight_versions=weight_versions)
    lag = torch.where(valid, version - weight_versions.to(torch.int64), 0)
    if bool((lag < 0).any()):
        raise ValueError(f"a token's weight version {int(weight_versions[valid].max())} is newer than the "
                         f"trainer's {version}")
    return lag


def offpolicy_metrics(weight_versions: torch.Tensor, mask: torch.Tensor, version: int,
                      tis_weights: torch.Tensor | None = None) -> dict[str, float]:
    """offpolicy_token_share (valid tokens with lag > 0), version_lag_mean (over valid tokens),
    version_lag_max, and with TIS weights offpolicy_tis_weight (their mean over lagging tokens;
    0 when there are none)."""
    valid = valid_tokens(mask)
    lag = version_lag(weight_versions, mask, version)
    n = max(int(valid.sum()), 1)
    behind = valid & (lag > 0)
    out = {"offpolicy_token_share": float(behind.sum()) / n,
           "version_lag_mean": float(lag.sum()) / n,
           "version_lag_max": float(lag.max()) if lag.numel() else 0.0}
    if tis_weights is not None:
        out["offpolicy_tis_weight"] = float(tis_weights[behind].double().mean()) if bool(behind.any()) else 0.0
    return out
