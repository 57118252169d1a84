"""Generalised advantage estimation (GAE) over a masked batch of responses."""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens
from algorithms.scan import masked_discounted_cumsum, next_valid_index


def check_discount(gamma: float, lam: float) -> None:
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


def compute_gae(
    rewards: torch.Tensor,  # [B, T]
    values: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T], 1 = response token that counts
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, both [B, T] (float32, or float64 for float64 input).

    Masked positions (tool output, padding) are skipped, not treated as steps, as in
    verl: a valid token's next value is the value at the next *valid* token, masked
    positions add no TD error, and they hold the next valid token's advantage. The
    last valid token bootstraps with 0. Rewards and values at masked positions are
    never read. returns = advantages + values, at every position.

        delta[t] = r[t] + gamma * V[next valid] - V[t]
        A[t]     = delta[t] + gamma * lam * A[next valid]
    """
    check_discount(gamma, lam)
    valid = valid_tokens(mask, rewards=rewards, values=values)
    dtype = compute_dtype(rewards, values)
    r = masked(rewards, valid, dtype)
    v = masked(values, valid, dtype)
    batch = v.shape[0]
    next_values = torch.cat([v, v.new_zeros(batch, 1)], dim=1).gather(1, next_valid_index(valid, inclusive=False))
    deltas = torch.where(valid, r + gamma * next_values - v, 0.0)
    advantages = masked_discounted_cumsum(deltas, valid, gamma * lam)
    return advantages, advantages + values.to(dtype)
