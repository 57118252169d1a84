"""Token entropy of the policy's categorical distribution."""

import torch

from algorithms._tensors import compute_dtype


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] of softmax(logits) for logits [B, T, V], differentiable.

    Built on log_softmax, so large logits do not overflow. Logits of -inf (banned
    tokens) have probability 0 and add 0: their log-probs are clamped to the most
    negative finite value so that 0 * log p is 0, in the gradient too.
    """
    dtype = compute_dtype(logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1).clamp_min(torch.finfo(dtype).min)
    return -(logp.exp() * logp).sum(-1)
