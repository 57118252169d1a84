"""Input checks and the dtype rule shared by every function in algorithms."""

import torch


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64 (so gradcheck works), else float32.

    bf16/fp16 inputs are upcast: advantages, ratios and sums over thousands of
    tokens lose too much in 8 mantissa bits.
    """
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def valid_tokens(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """Check that mask is [B, T] and every named tensor has its shape; return mask as bool."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(mask.shape)} (the shape of mask)"
            )
    return mask != 0


def masked(x: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype with masked positions set to 0.

    torch.where rather than a multiply: padding may hold inf or NaN (log-probs of
    pad tokens), and 0 * inf is NaN in the forward pass and in the gradient.
    """
    return torch.where(valid, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))
