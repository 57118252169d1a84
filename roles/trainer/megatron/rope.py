"""Rotary position embedding for the megatron backend's local spec, with no host sync (pure torch).

Why not megatron's own: without transformer-engine megatron-core 0.19 applies THD (packed)
RoPE in `_apply_rotary_pos_emb_thd`, which reads cu_seqlens with `.tolist()` / `.item()`
(two host syncs per layer, for q and for k, again in recompute) and runs ~5 small kernels
per sequence. Here the positions come from cu_seqlens on the device (searchsorted), cos/sin
are computed once per packed batch and shared by every layer (`cos_sin`), and the rotation
is one autograd Function over the whole batch that saves only cos/sin.

The tables are roles.rope's, as the engine's decoder builds its own (megatron's unfused path
computes the same, with inv_freq on the device rather than the CPU); the rotation is out = t*cos +
rotate_half(t)*sin with each product rounded to t's dtype, as megatron rounds it. Applied by
roles.trainer.megatron.attention.SDPACoreAttention, after the q/k layernorms (Qwen3 qk-norm),
as megatron orders them.
"""

from __future__ import annotations

import torch

from roles.rope import Rope
from roles.trainer.megatron.batch_memo import per_batch


def packed_positions(cu_seqlens: torch.Tensor, total: int, *, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """[total] int64, on cu_seqlens' device: each local token's index within its whole sequence.

    cu_seqlens: int [B + 1] of the WHOLE sequences (megatron's convention with CP). cp_size 1:
    the tokens are the sequences concatenated. cp_size > 1: this rank's tokens in megatron's
    load-balanced layout (roles.trainer.megatron.attention.cp_local_index): per sequence of
    length L (a multiple of 2*cp), c = L / (2*cp) tokens of chunk cp_rank, then c of chunk
    2*cp-1-cp_rank. No host sync: `total` is the local token count the caller already knows.
    """
    cu = cu_seqlens.long()
    local_cu = cu // cp_size  # every length is a multiple of 2*cp, so every start divides
    idx = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(local_cu[1:], idx, right=True).clamp_(max=cu.numel() - 2)
    k = idx - local_cu[seq]
    if cp_size == 1:
        return k
    c = (cu[1:] - cu[:-1])[seq] // (2 * cp_size)
    return torch.where(k < c, cp_rank * c + k, (2 * cp_size - 1 - cp_rank) * c + (k - c))


def cos_sin(rope: Rope, dtype: torch.dtype, *, total: int, cu_seqlens: torch.Tensor | None = None,
            cp_size: int = 1, cp_rank: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [total, head_dim / 2] of `packed_positions` (cu_seqlens given) or of 0..total-1
    (padded sbhd batches: position = row); computed once per batch for every layer
    (roles.trainer.megatron.batch_memo)."""
    dev = cu_seqlens.device if cu_seqlens is not None else torch.device(device)

    def build():
        if cu_seqlens is None:
            positions = torch.arange(total, device=dev)
        else:
            positions = packed_positions(cu_seqlens, total, cp_size=cp_size, cp_rank=cp_rank)
        return rope.tables(positions, dtype)

    return per_batch(cu_seqlens, ("rope", rope, dtype, total, cp_size, cp_rank, str(dev)), build)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: int) -> torch.Tensor:
    """x*cos + sign*rotate_half(x)*sin on halves (cos/sin are the same in both halves),
    each product rounded to x's dtype before the sum, as megatron's unfused formula does."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1)
    torch.mul(x2, cos, out=o2)
    if sign > 0:  # rotate_half(x) = [-x2, x1]
        o1.sub_(x2 * sin)
        o2.add_(x1 * sin)
    else:
        o1.add_(x2 * sin)
        o2.sub_(x1 * sin)
    return out


class _Rotary(torch.autograd.Function):
    """out = t*cos + rotate_half(t)*sin; grad_t = g*cos - rotate_half(g)*sin (rotate_half's
    transpose is its negation). Saves only cos/sin."""

    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, +1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1), None, None


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate t [..., head_dim]; cos/sin [..., head_dim / 2] broadcast to t's halves
    (thd: [t, 1, d/2] for t [t, n, d]; sbhd: [s, 1, 1, d/2] for t [s, b, n, d])."""
    if t.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(f"apply_rope: head_dim {t.shape[-1]} != 2 x the tables' width {cos.shape[-1]}")
    return _Rotary.apply(t, cos.to(t.dtype), sin.to(t.dtype))
