"""Core attention for megatron's local layer spec without transformer-engine.

megatron's own DotProductAttention builds the full [b, n, s, s] score matrix, refuses
packed sequences and has no context parallelism. `SDPACoreAttention` replaces it as the
spec's `core_attention` submodule (same constructor and forward arguments):

  padded  [s, b, n, d] (sbhd)    torch SDPA, causal, GQA without repeating K/V
  packed  [t, n, d] (thd)        torch.nn.attention.varlen (flash) on CUDA half types; the
                                 same math per sequence with SDPA elsewhere (`attend_packed`)
  context parallel (thd only)    K/V all-gathered over the CP group; megatron's load-balanced
                                 layout: every sequence (length divisible by 2*cp) is cut into
                                 2*cp chunks and CP rank r holds chunks r and 2*cp-1-r, in that
                                 order; its two query chunks attend to the K/V prefixes that end
                                 with them (causal, aligned bottom-right)

cu_seqlens in PackedSeqParams are those of the whole sequences (megatron's convention with
CP, as transformer-engine reads them); each rank holds 1/cp of every sequence's tokens.

RoPE: given `rope` (roles.trainer.megatron.model passes it through the spec, and builds
GPTModel with position_embedding_type="none"), q and k are rotated here, on entry, by
roles.trainer.megatron.rope: megatron's unfused THD RoPE syncs with the host twice per layer
and loops over the sequences (that module says why). megatron has applied the q/k layernorms
before calling core attention, so the order is megatron's. Positions: sbhd row s; thd the
token's index within its whole sequence; with CP the global positions of this rank's chunks.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from roles.rope import Rope
from roles.trainer.megatron.batch_memo import per_batch
from roles.trainer.megatron.rope import apply_rope, cos_sin

# ---- packed attention (one call per batch of segments) -------------------------------------


def _segment_reference(q, k, v, cu_q, cu_k, scale):
    """attend_packed's math, one SDPA call per segment with an explicit bottom-right causal mask."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        lq, lk = qe - qs, ke - ks
        if lq == 0:
            continue
        # query j sees keys 0..j + (lk - lq): the query segment is the end of the key segment
        mask = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


@functools.lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its keyword names) when this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_usable(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _varlen() is not None


def attend_packed(q, k, v, cu_q, cu_k, max_q: int, max_k: int, *, scale: float,
                  reference: bool = False) -> torch.Tensor:
    """Causal attention of query segment i (rows cu_q[i]:cu_q[i+1]) to key segment i.

    q [Tq, n, d], k/v [Tk, g, d] with g dividing n (GQA); a query segment shorter than its
    key segment is the key segment's tail (bottom-right aligned causal mask, as flash
    attention defines it). Returns [Tq, n, d].
    """
    if reference or not varlen_usable(q):
        return _segment_reference(q, k, v, cu_q, cu_k, scale)
    varlen_attn, params = _varlen()
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "scale" in params:
        kwargs["scale"] = scale
    else:
        q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel scales by 1/sqrt(d)
    cu_q, cu_k = cu_q.to(q.device, torch.int32), cu_k.to(q.device, torch.int32)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


# ---- context parallelism ---------------------------------------------------------------------


class _AllGather(torch.autograd.Function):
    """Concatenate every CP rank's tensor along dim 0; the gradient of each rank's part is
    the sum over ranks (all-reduce, then this rank's slice: works on gloo and NCCL)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.n = group, dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def cp_local_index(seqlens: list[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions in the packed whole sequences of the tokens CP rank `cp_rank` holds, in
    its order: for each sequence, chunk cp_rank then chunk 2*cp_size-1-cp_rank."""
    out, start = [], 0
    for length in seqlens:
        if length % (2 * cp_size):
            raise ValueError(f"sequence length {length} is not a multiple of 2*context_parallel_size={2 * cp_size}")
        c = length // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.append(torch.arange(start + chunk * c, start + (chunk + 1) * c))
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


@dataclass(kw_only=True, frozen=True)
class _CPPlan:
    """Index tensors of attend_packed_cp for one batch, on the device (batch_memo)."""

    inverse: torch.Tensor  # gathered rank-major tokens -> packed order
    q_order: torch.Tensor  # local rows regrouped: every front chunk, then every back chunk
    key_index: torch.Tensor  # for each query chunk, the whole-sequence prefix that ends with it
    cu_q: torch.Tensor  # int32
    cu_k: torch.Tensor  # int32
    max_q: int
    max_k: int


def _cp_plan(cu_seqlens: torch.Tensor, cp: int, rank: int, device) -> _CPPlan:
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()  # the batch's one host sync (memoised)
    # Rank j's tokens sit at cp_local_index(j) of the whole sequences: invert the layout.
    order = torch.cat([cp_local_index(seqlens, cp, j) for j in range(cp)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    # Segment list: front chunks of every sequence, then back chunks; each attends to the
    # whole-sequence prefix ending with it.
    key_index, cu_k, q_lens, max_k = [], [0], [], 0
    starts = [0] + list(torch.tensor(seqlens).cumsum(0).tolist())
    for chunk_of in (lambda: rank, lambda: 2 * cp - 1 - rank):
        for i, length in enumerate(seqlens):
            c = length // (2 * cp)
            end = (chunk_of() + 1) * c
            key_index.append(torch.arange(starts[i], starts[i] + end))
            cu_k.append(cu_k[-1] + end)
            q_lens.append(c)
            max_k = max(max_k, end)
    # Local query rows are [front_0, back_0, front_1, back_1, ...]; regroup fronts first.
    local = []
    offset = 0
    for length in seqlens:
        c = length // (2 * cp)
        local.append((offset, offset + c))
        offset += 2 * c
    q_order = torch.cat([torch.arange(s, s + (e - s)) for s, e in local]
                        + [torch.arange(e, e + (e - s)) for s, e in local])
    return _CPPlan(inverse=inverse.to(device), q_order=q_order.to(device), key_index=torch.cat(key_index).to(device),
                   cu_q=torch.tensor([0] + q_lens).cumsum(0).to(device, torch.int32),
                   cu_k=torch.tensor(cu_k).to(device, torch.int32), max_q=max(q_lens), max_k=max_k)


def attend_packed_cp(q, k, v, cu_seqlens: torch.Tensor, group, *, scale: float, reference: bool = False):
    """Causal packed attention of this CP rank's query chunks against the whole sequences.

    q [t, n, d], k/v [t, g, d]: this rank's tokens in cp_local_index order, t = total / cp.
    The index plan is built once per batch (one host sync) and reused by every layer.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    plan = per_batch(cu_seqlens, ("cp", cp, rank, str(q.device)), lambda: _cp_plan(cu_seqlens, cp, rank, q.device))
    k_full = _AllGather.apply(k, group)[plan.inverse]
    v_full = _AllGather.apply(v, group)[plan.inverse]
    out = attend_packed(q[plan.q_order], k_full[plan.key_index], v_full[plan.key_index], plan.cu_q, plan.cu_k,
                        plan.max_q, plan.max_k, scale=scale, reference=reference)
    result = torch.empty_like(out)
    result[plan.q_order] = out
    return result


# ---- the module --------------------------------------------------------------------------------


class SDPACoreAttention(nn.Module):
    """Drop-in for megatron's DotProductAttention (local spec), see the module docstring."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, rope: Rope | None = None):
        super().__init__()
        self.rope = rope  # None: q and k arrive rotated (transformer-engine's spec, tests)
        if (attention_dropout if attention_dropout is not None else config.attention_dropout) != 0:
            raise ValueError("SDPACoreAttention: attention_dropout must be 0 (RL training runs without dropout)")
        self.config = config
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.cp_group = None
        if config.context_parallel_size > 1:
            if pg_collection is None or getattr(pg_collection, "cp", None) is None:
                from megatron.core import parallel_state

                self.cp_group = parallel_state.get_context_parallel_group()
            else:
                self.cp_group = pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias is not supported")
        if self.rope is not None:
            query, key = self._rotate(query, key, packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q
            if self.cp_group is not None:
                out = attend_packed_cp(query, key, value, cu, self.cp_group, scale=self.scale)
            else:
                max_len = int(packed_seq_params.max_seqlen_q)
                out = attend_packed(query, key, value, cu, cu, max_len, max_len, scale=self.scale)
            return out.reshape(out.shape[0], -1)  # [t, n*d]
        if self.cp_group is not None:
            raise ValueError("SDPACoreAttention: context parallelism needs packed (thd) sequences")
        # sbhd -> bhsd; SDPA's causal mask is top-left aligned, right padding needs nothing more
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask = None if attention_mask is None else ~attention_mask  # megatron: True = masked out
        causal_and = None
        if mask is not None:
            s_q, s_k = q.shape[2], k.shape[2]
            causal_and = mask & torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_and, is_causal=mask is None,
                                             scale=self.scale, enable_gqa=True)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n*d]

    def _rotate(self, query, key, packed_seq_params):
        """q and k with RoPE at their positions (module docstring); no host sync."""
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cp = (1, 0) if self.cp_group is None else (dist.get_world_size(self.cp_group),
                                                       dist.get_rank(self.cp_group))
            cos, sin = cos_sin(self.rope, query.dtype, total=query.shape[0], cu_seqlens=packed_seq_params.cu_seqlens_q,
                               cp_size=cp[0], cp_rank=cp[1])
            cos, sin = cos[:, None], sin[:, None]  # [t, 1, d/2] over heads
        else:
            cos, sin = cos_sin(self.rope, query.dtype, total=query.shape[0], device=query.device)
            cos, sin = cos[:, None, None], sin[:, None, None]  # [s, 1, 1, d/2] over batch and heads
        return apply_rope(query, cos, sin), apply_rope(key, cos, sin)
