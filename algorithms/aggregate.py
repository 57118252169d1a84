"""Reduce a per-token loss [B, T] to a scalar, correctly under data-parallel sharding."""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum-of-sample-mean")

Count = int | float | torch.Tensor


def _denominator(count: Count | None, default: torch.Tensor, name: str, like: torch.Tensor) -> torch.Tensor:
    if count is None:
        count = default
    elif not isinstance(count, torch.Tensor) and count <= 0:
        raise ValueError(f"{name} must be > 0, got {count}")
    # An empty batch (count 0) sums to 0; dividing by 1 keeps it 0 instead of NaN.
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp_min(1)


def aggregate(
    values: torch.Tensor,  # [B, T] per-token loss
    mask: torch.Tensor,  # [B, T]
    mode: str,
    global_batch_size: Count | None = None,
    global_token_count: Count | None = None,
) -> torch.Tensor:
    """Scalar reduction of values over valid tokens.

    Modes (row = one sample; masked tokens never count):
      token-mean           sum of all valid tokens / N
      seq-mean-token-mean  sum over rows of the row's token mean / S
      seq-mean-token-sum   sum over rows of the row's token sum / S
      sum-of-sample-mean   sum over rows of the row's token mean / G   (miles' default)

    N = global_token_count, default: valid tokens in this batch.
    S = global_batch_size, default: rows of this batch with at least one valid token
        (verl: empty rows are excluded from the sequence mean).
    G = global_batch_size, default: all rows of this batch, empty ones included.
    Each mode reads only its own count; the other is ignored.

    Sharding contract: when a batch is split across ranks (or micro-batches) and every
    shard passes the whole batch's N (token-mean) or S / G (the others), the shards'
    results sum to the result on the unsharded batch. Under DDP/FSDP gradient
    averaging, multiply by the world size to get the same gradient. Empty rows,
    empty batches and zero counts give 0, never NaN.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"aggregation mode must be one of {AGG_MODES}, got {mode!r}")
    valid = valid_tokens(mask, values=values)
    x = masked(values, valid, compute_dtype(values))
    tokens_per_row = valid.sum(-1).to(x.dtype)
    if mode == "token-mean":
        return x.sum() / _denominator(global_token_count, tokens_per_row.sum(), "global_token_count", x)
    row_sums = x.sum(-1)
    if mode == "seq-mean-token-sum":
        per_row = row_sums
    else:
        per_row = row_sums / tokens_per_row.clamp_min(1)
    if mode == "sum-of-sample-mean":
        default_rows = torch.tensor(float(valid.shape[0]))
    else:
        default_rows = (tokens_per_row > 0).sum()
    return per_row.sum() / _denominator(global_batch_size, default_rows, "global_batch_size", x)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values over valid tokens (0 when none), for metrics."""
    return aggregate(values, mask, "token-mean")
