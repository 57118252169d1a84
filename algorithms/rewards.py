"""Token-level rewards: an outcome score on the last response token, plus KL shaping."""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens


def last_valid_token(valid: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: True only at each row's last valid position (no True in empty rows)."""
    positions = torch.arange(valid.shape[1], device=valid.device)
    last = torch.where(valid, positions, -1).amax(-1, keepdim=True)
    return positions == last


def token_level_rewards(
    scores: torch.Tensor,  # [B] outcome score per response
    mask: torch.Tensor,  # [B, T]
    kl: torch.Tensor | None = None,  # [B, T] e.g. kl_estimate(old_logp, ref_logp, "k1")
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """[B, T] rewards: -kl_coef * kl on every valid token, plus the score on the last one.

    Reward-level KL shaping (InstructGPT, verl's use_kl_in_reward): the penalty enters
    the returns, so GAE and REINFORCE++ discount it like any reward. Masked positions
    are 0; an all-masked row gets no score (there is no token to put it on).
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [batch] = [{mask.shape[0]}], got shape {tuple(scores.shape)}")
    if kl is None and kl_coef != 0.0:
        raise ValueError(f"kl_coef is {kl_coef} but kl is None; pass per-token kl (see kl_estimate) or kl_coef=0")
    valid = valid_tokens(mask, kl=kl)
    dtype = compute_dtype(scores, kl)
    rewards = torch.where(last_valid_token(valid), scores.to(dtype).unsqueeze(-1), 0.0)
    if kl is not None:
        rewards = rewards - kl_coef * masked(kl, valid, dtype)
    return rewards
