"""Masked whitening, locally or over a batch sharded across data-parallel ranks.

Across ranks, all-reduce (SUM) the moments before whitening:

    moments = masked_moments(advantages, mask)          # float64 [3]
    torch.distributed.all_reduce(moments)                # whole-batch sums
    advantages = whiten_with_moments(advantages, mask, moments)
"""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float64 tensor [3]: (sum, sum of squares, count) of x over valid positions.

    Plain sums so that shards combine by addition (one all-reduce). float64 because
    the variance is later formed as sumsq - sum**2 / count, which cancels badly in
    float32 when the mean is large next to the spread.
    """
    valid = valid_tokens(mask, x=x)
    xv = masked(x, valid, torch.float64)
    return torch.stack([xv.sum(), (xv * xv).sum(), valid.sum().to(torch.float64)])


def whiten_with_moments(
    x: torch.Tensor,
    mask: torch.Tensor,
    moments: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var taken from moments.

    moments is masked_moments' (sum, sumsq, count), possibly summed over ranks. With
    shift_mean=False the mean is added back, so only the spread is normalised (the
    TRL/verl convention). Masked positions of the result are 0. Raises ValueError
    when the moments cover fewer than 2 valid elements (no unbiased variance).
    """
    valid = valid_tokens(mask, x=x)
    total, total_sq, count = moments.to(torch.float64).unbind()
    if count.item() < 2:
        raise ValueError(
            f"whitening needs at least 2 valid elements for an unbiased variance, got {int(count.item())}; "
            "check the mask, or skip whitening for this batch"
        )
    dtype = compute_dtype(x)
    mean = total / count
    # Rounding can leave a tiny negative value when every element is equal.
    var = ((total_sq - total * mean) / (count - 1)).clamp_min(0.0)
    mean, rstd = mean.to(dtype), torch.rsqrt(var + eps).to(dtype)
    whitened = (masked(x, valid, dtype) - mean) * rstd
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, 0.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Whiten x over its own valid positions; see whiten_with_moments."""
    return whiten_with_moments(x, mask, masked_moments(x, mask), shift_mean=shift_mean, eps=eps)
