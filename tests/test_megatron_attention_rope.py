"""RoPE in the megatron backend's core attention (roles.trainer.megatron.rope, applied by
roles.trainer.megatron.attention.SDPACoreAttention) against references written here:

- `megatron_rope`: megatron-core 0.19.2's unfused formula (rope_utils._apply_rotary_pos_emb_bshd
  with RotaryEmbedding.get_emb's freqs), rewritten: float32 freqs = position x inv_freq,
  emb = [freqs, freqs], cos/sin cast to t's dtype, t*cos + rotate_half(t)*sin. It differs from
  megatron's in taking explicit positions instead of slicing a [max_seqlen] table per sequence.
- positions: restart at 0 per packed sequence; under CP the global positions of the
  load-balanced chunks (the CP ranks' positions in cp_local_index order equal one rank's).
- the module with rope: packed vs per-sequence naive attention on rotated q/k vs padded sbhd,
  and CP on 2 gloo ranks vs one rank (forward and gradients).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roles.trainer.megatron import batch_memo
from roles.trainer.megatron.attention import SDPACoreAttention, cp_local_index
from roles.rope import Rope
from roles.trainer.megatron.rope import apply_rope, cos_sin, packed_positions
from tests.test_megatron_attention import (
    SEQLENS_CP,
    D,
    N_HEADS,
    assert_cp_ranks_match,
    cp_worker,
    naive_causal,
    packed_params,
    qkv,
)

PARAMS = Rope(theta=10000.0, head_dim=D)


def megatron_rope(t: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """t [s, ..., d] at positions [s]: megatron's unfused RoPE (module docstring)."""
    d = t.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(positions.to(torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).view(len(positions), *([1] * (t.dim() - 2)), d)
    cos_, sin_ = torch.cos(emb).to(t.dtype), torch.sin(emb).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)
    return t * cos_ + torch.cat((-x2, x1), dim=-1) * sin_


def rotated(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = PARAMS.tables(positions, t.dtype)
    shape = (len(positions),) + (1,) * (t.dim() - 2) + (D // 2,)
    return apply_rope(t, cos.view(shape), sin.view(shape))


@pytest.fixture(autouse=True)
def _fresh_tables():
    batch_memo.drop()
    yield
    batch_memo.drop()


# ---- the rotation --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotation_is_megatrons_unfused_formula_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    t = (torch.randn(40, N_HEADS, D, generator=gen) * 3).to(dtype).requires_grad_()
    positions = torch.arange(40) * 977  # far positions: cos/sin rounding matters
    ours = rotated(t, positions)
    ref_t = t.detach().clone().requires_grad_()
    ref = megatron_rope(ref_t, positions, PARAMS.theta)
    assert ours.dtype == dtype and torch.equal(ours, ref)
    g = torch.randn(ours.shape, generator=gen).to(dtype)
    ours.backward(g)
    ref.backward(g)
    # autograd through megatron's formula rounds the same products: the same gradient
    assert torch.equal(t.grad, ref_t.grad)


def test_rotation_gradcheck_float64_and_only_cos_sin_saved():
    gen = torch.Generator().manual_seed(1)
    t = torch.randn(6, 2, 3, D, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = PARAMS.tables(torch.arange(6) * 5, torch.float64)
    cos, sin = cos[:, None, None], sin[:, None, None]
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos, sin), (t,))
    out = apply_rope(t, cos, sin)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 2 and all(s.shape == cos.shape for s in saved)
    # rotation preserves each pair's norm: position 0 is the identity
    torch.testing.assert_close(apply_rope(t, cos, sin)[0], t[0].detach(), rtol=0, atol=0)


def test_rotation_on_a_strided_view_and_width_checked():
    # megatron hands q/k over as views of the qkv projection
    base = torch.randn(5, N_HEADS, 3 * D, dtype=torch.float64)
    view = base[..., D:2 * D]
    cos, sin = PARAMS.tables(torch.arange(5), torch.float64)
    torch.testing.assert_close(apply_rope(view, cos[:, None], sin[:, None]),
                               megatron_rope(view.contiguous(), torch.arange(5), PARAMS.theta), rtol=0, atol=0)
    with pytest.raises(ValueError, match="head_dim 16 != 2 x the tables' width 4"):
        apply_rope(torch.zeros(5, 1, 16), cos[:, None], sin[:, None])


# ---- positions ---------------------------------------------------------------------------------


def cu_of(seqlens):
    return torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)


def test_packed_positions_restart_per_sequence():
    seqlens = [5, 1, 12, 7]
    expect = torch.cat([torch.arange(n) for n in seqlens])
    assert torch.equal(packed_positions(cu_of(seqlens), sum(seqlens)), expect)
    # an empty sequence in the pack changes nothing for the others
    assert torch.equal(packed_positions(cu_of([5, 0, 1, 12, 7]), sum(seqlens)), expect)


@pytest.mark.parametrize("cp, seqlens", [(2, [8, 4, 12]), (3, [6, 18, 12])])
def test_cp_positions_are_the_one_rank_positions_of_the_local_tokens(cp, seqlens):
    whole = packed_positions(cu_of(seqlens), sum(seqlens))
    per_rank = [packed_positions(cu_of(seqlens), sum(seqlens) // cp, cp_size=cp, cp_rank=r) for r in range(cp)]
    order = torch.cat([cp_local_index(seqlens, cp, r) for r in range(cp)])
    assert torch.equal(torch.cat(per_rank), whole[order])


def test_tables_are_shared_per_batch_and_recomputed_when_it_changes():
    cu = cu_of([3, 5])
    first = cos_sin(PARAMS, torch.float32, total=8, cu_seqlens=cu)
    assert cos_sin(PARAMS, torch.float32, total=8, cu_seqlens=cu)[0] is first[0]  # the next layer: no recompute
    cu[1:] = cu_of([5, 3])[1:]  # reused buffer, new batch: its version changed
    second = cos_sin(PARAMS, torch.float32, total=8, cu_seqlens=cu)
    assert second[0] is not first[0]
    torch.testing.assert_close(second[0], PARAMS.tables(packed_positions(cu, 8), torch.float32)[0])
    batch_memo.drop()
    assert not batch_memo._MEMO
    padded = cos_sin(PARAMS, torch.bfloat16, total=6, device="cpu")
    torch.testing.assert_close(padded[1], PARAMS.tables(torch.arange(6), torch.bfloat16)[1], rtol=0, atol=0)


# ---- the module with rope ------------------------------------------------------------------------


def rope_module(cp_group=None) -> SDPACoreAttention:
    cp_size = 1 if cp_group is None else cp_group.size()
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=D, context_parallel_size=cp_size)
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=None,
                             pg_collection=SimpleNamespace(cp=cp_group), rope=PARAMS)


def test_packed_padded_and_per_sequence_reference_agree_with_rope():
    seqlens = [5, 1, 12, 7]
    q, k, v = qkv(sum(seqlens), seed=4)
    packed = rope_module()(q, k, v, None, packed_seq_params=packed_params(seqlens)).view_as(q)
    scale = 1 / math.sqrt(D)
    start = 0
    s, b = max(seqlens), len(seqlens)
    pq, pk, pv = (torch.zeros(s, b, *x.shape[1:], dtype=x.dtype) for x in (q, k, v))
    for i, n in enumerate(seqlens):
        sl = slice(start, start + n)
        pos = torch.arange(n)
        expect = naive_causal(megatron_rope(q[sl], pos, PARAMS.theta), megatron_rope(k[sl], pos, PARAMS.theta),
                              v[sl], scale)
        torch.testing.assert_close(packed[sl], expect, rtol=1e-10, atol=1e-10)
        pq[:n, i], pk[:n, i], pv[:n, i] = q[sl], k[sl], v[sl]
        start += n
    padded = rope_module()(pq, pk, pv, None).view(s, b, N_HEADS, D)
    start = 0
    for i, n in enumerate(seqlens):
        torch.testing.assert_close(padded[:n, i], packed[start:start + n], rtol=1e-10, atol=1e-10)
        start += n
    # without rope the module is unchanged: different outputs (positions matter)
    plain = SDPACoreAttention(SimpleNamespace(attention_dropout=0.0, kv_channels=D, context_parallel_size=1), 1, None)
    assert not torch.allclose(plain(q, k, v, None, packed_seq_params=packed_params(seqlens)).view_as(q), packed)


def _cp_rope_worker(rank: int, group) -> dict:
    from roles.trainer.megatron import attention, rope

    got = cp_worker(rank, group, make_module=rope_module, seed=5)
    # every layer of one batch shares its gather plan and rope tables: built by the first only
    built = []
    for name, mod in (("cp", attention), ("rope", rope)):
        fn = getattr(mod, {"cp": "_cp_plan", "rope": "packed_positions"}[name])
        setattr(mod, fn.__name__, lambda *a, fn=fn, name=name, **kw: built.append(name) or fn(*a, **kw))
    q, k, v = (x[got["idx"]] for x in qkv(sum(SEQLENS_CP), seed=5))
    params = packed_params(SEQLENS_CP)
    for _ in range(3):
        rope_module(cp_group=group)(q, k, v, None, packed_seq_params=params)
    return {**got, "built": sorted(built)}


@pytest.mark.timeout(120)
def test_context_parallel_with_rope_on_two_gloo_ranks_matches_one_rank(tmp_path):
    from tests.test_megatron_parallel import run_gloo_ranks

    ranks = run_gloo_ranks(_cp_rope_worker, tmp_path)
    assert all(got["built"] == ["cp", "rope"] for got in ranks)
    params = packed_params(SEQLENS_CP)
    assert_cp_ranks_match(ranks, lambda q, k, v: rope_module()(q, k, v, None, packed_seq_params=params), seed=5)
