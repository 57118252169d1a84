"""Triton kernels of the GPU decode step: the waste of a decode step at small batch is kernel
count and re-reading the KV cache, not arithmetic.

- `rope_and_store`: one kernel from the fused q|k|v projection to attention inputs. Per
  token and head it applies Qwen3's per-head RMSNorm, rope at the token's position (read
  from the cos/sin tables, no gather kernel), writes the key and value into the token's
  cache slot, and the query to a [N, H, D] buffer. It replaces the norm/rope kernels, two
  index_put kernels and the cos/sin gathers of the torch path (decoder.attention_inputs).
- `decode_attention`: one query token per row against its slot's cached keys/values
  `[0, length)`. A program owns one (row, KV head, split): it reads that head's keys once
  for all of its G query heads (GQA), so the cache is read once per step, not G times.
  Long slots are split across programs (split-K) when rows x heads alone cannot fill the
  GPU; a second small kernel merges the splits by their log-sum-exp. Lengths are read on
  the device, so one CUDA graph serves every length up to the slot's.

Rounding follows the torch path where it is cheap (norm statistics in fp32, the scaled
value rounded to the model dtype before the weight); attention accumulates in fp32 with
probabilities rounded to the model dtype for the P.V product, as flash attention does.
Tests: tests/test_rollout_gpu.py (equal to the torch path within bf16 tolerance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64  # cache positions per attention tile
SPLIT_MIN = 256  # a split covers at least this many positions (fewer: merge overhead wins)


@triton.jit
def _rope_and_store_kernel(
    qkv, cos, sin, q_norm, k_norm, positions, slots, q_out, k_cache, v_cache,
    stride_qkv, stride_cos, stride_qo_n, stride_qo_h,
    stride_cs, stride_ch, stride_ct,
    eps,
    H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)  # [0, H): query heads; [H, H + KV): keys; [H + KV, H + 2 KV): values
    half = tl.arange(0, D // 2)
    row = qkv + n * stride_qkv + h * D
    x1 = tl.load(row + half)
    x2 = tl.load(row + D // 2 + half)
    slot = tl.load(slots + n)
    pos = tl.load(positions + n)
    if h >= H + KV:  # a value: stored as is
        base = v_cache + slot * stride_cs + (h - H - KV) * stride_ch + pos * stride_ct
        tl.store(base + half, x1)
        tl.store(base + D // 2 + half, x2)
    else:
        dtype = x1.dtype
        if h < H:
            w = q_norm
            base = q_out + n * stride_qo_n + h * stride_qo_h
        else:
            w = k_norm
            base = k_cache + slot * stride_cs + (h - H) * stride_ch + pos * stride_ct
        if QK_NORM:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / D + eps)
            x1 = (tl.load(w + half).to(tl.float32) * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
            x2 = (tl.load(w + D // 2 + half).to(tl.float32) * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
        c1 = tl.load(cos + pos * stride_cos + half).to(tl.float32)
        c2 = tl.load(cos + pos * stride_cos + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin + pos * stride_cos + half).to(tl.float32)
        s2 = tl.load(sin + pos * stride_cos + D // 2 + half).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, each product rounded as the torch path rounds it
        y1 = ((f1 * c1).to(dtype).to(tl.float32) + (-f2 * s1).to(dtype).to(tl.float32)).to(dtype)
        y2 = ((f2 * c2).to(dtype).to(tl.float32) + (f1 * s2).to(dtype).to(tl.float32)).to(dtype)
        tl.store(base + half, y1)
        tl.store(base + D // 2 + half, y2)


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                   k_norm: torch.Tensor | None, positions: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                   eps: float) -> torch.Tensor:
    """q [N, H, D] from qkv [N, (H + 2 KV) D]; k, v written to cache[slots[n], :, positions[n]].

    cos/sin: [T, D] tables by position; caches: [S, KV, T, D] with unit stride along D.
    """
    n = qkv.shape[0]
    d = cos.shape[-1]
    assert qkv.stride(-1) == 1 and cos.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    q = torch.empty(n, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None
    _rope_and_store_kernel[(n, num_heads + 2 * num_kv_heads)](
        qkv, cos, sin, q_norm if norm else cos, k_norm if norm else cos, positions, slots, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        eps, H=num_heads, KV=num_kv_heads, D=d, QK_NORM=norm, num_warps=1,
    )
    return q


@triton.jit
def _decode_attention_kernel(
    q, k_cache, v_cache, lengths, out, part_out, part_lse,
    stride_qb, stride_qh, stride_cs, stride_ch, stride_ct,
    stride_pb, stride_ph, stride_ps,
    scale, chunk,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # KV head
    sp = tl.program_id(2)
    length = tl.load(lengths + b).to(tl.int32)
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    rows = tl.arange(0, G_PAD)
    cols = tl.arange(0, D)
    heads = g * G + rows
    row_ok = rows < G
    qt = tl.load(q + b * stride_qb + heads[:, None] * stride_qh + cols[None, :], mask=row_ok[:, None], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    base = b.to(tl.int64) * stride_cs + g * stride_ch  # a whole cache can pass 2**31 elements
    offs = tl.arange(0, BLOCK)
    for n0 in range(start, end, BLOCK):
        pos = n0 + offs
        ok = pos < end
        at = base + pos[:, None] * stride_ct + cols[None, :]
        k = tl.load(k_cache + at, mask=ok[:, None], other=0.0)
        scores = tl.dot(qt, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, BLOCK] fp32
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + at, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:
        # an empty split (start >= length) leaves lse = -inf: weight 0 in the merge
        empty = s_sum == 0.0
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, s_sum)))
        o = acc / tl.where(empty, 1.0, s_sum)[:, None]
        where = b * stride_pb + heads * stride_ph + sp * stride_ps
        tl.store(part_lse + where, lse, mask=row_ok)
        tl.store(part_out + where[:, None] * D + cols[None, :], o, mask=row_ok[:, None])
    else:
        o = acc / s_sum[:, None]
        tl.store(out + b * stride_qb + heads[:, None] * stride_qh + cols[None, :], o.to(qt.dtype),
                 mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out, stride_pb, stride_ph, stride_ob, stride_oh,
                         SPLITS: tl.constexpr, S_PAD: tl.constexpr, D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    cols = tl.arange(0, D)
    where = b * stride_pb + h * stride_ph + s
    lse = tl.load(part_lse + where, mask=s < SPLITS, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    o = tl.load(part_out + where[:, None] * D + cols[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out + b * stride_ob + h * stride_oh + cols, merged.to(out.dtype.element_ty))


def num_splits(batch: int, num_kv_heads: int, slot_len: int, num_sms: int) -> int:
    """Splits per (row, KV head): enough programs for ~4 per SM, each split >= SPLIT_MIN positions."""
    want = -(-4 * num_sms // (batch * num_kv_heads))
    return max(1, min(want, slot_len // SPLIT_MIN))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     *, splits: int) -> torch.Tensor:
    """out [B, H, D] = softmax(q k^T / sqrt(D)) v over cache positions [0, lengths[b]) of slot b.

    q: [B, H, D]; caches: [S >= B, KV, T, D] (unit stride along D); lengths: [B] int, >= 1.
    """
    batch, heads, d = q.shape
    kv, slot_len = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    chunk = -(-slot_len // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    out = torch.empty_like(q)
    split = splits > 1
    if split:
        part_out = torch.empty(batch, heads, splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    cs = k_cache.stride()
    _decode_attention_kernel[(batch, kv, splits)](
        q, k_cache, v_cache, lengths, out, part_out, part_lse,
        q.stride(0), q.stride(1), cs[0], cs[1], cs[2],
        heads * splits, splits, 1,
        d ** -0.5, chunk,
        G=group, G_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK=BLOCK_N, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32 engines: no TF32 rounding
        num_warps=4, num_stages=2,
    )
    if split:
        _merge_splits_kernel[(batch, heads)](
            part_out, part_lse, out, heads * splits, splits, out.stride(0), out.stride(1),
            SPLITS=splits, S_PAD=triton.next_power_of_2(splits), D=d, num_warps=1,
        )
    return out
