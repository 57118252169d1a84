"""The core attention module of the megatron backend (roles.trainer.megatron.attention)
against a naive reference written here: explicit scores, causal mask, softmax, per sequence.

Covers the padded (sbhd) and packed (thd) paths, GQA, and context parallelism with its
load-balanced chunks, on a real gloo group of 2 processes (forward and gradients).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roles.trainer.megatron.attention import SDPACoreAttention, cp_local_index

N_HEADS, N_GROUPS, D = 4, 2, 8


def naive_causal(q, k, v, scale):
    """q [s, n, d], k/v [s, g, d] of ONE sequence -> [s, n, d]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qnd,knd->nqk", q, k) * scale
    s = q.shape[0]
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("nqk,knd->qnd", scores.softmax(-1), v)


def naive_packed(q, k, v, seqlens, scale):
    outs, start = [], 0
    for length in seqlens:
        outs.append(naive_causal(q[start:start + length], k[start:start + length], v[start:start + length], scale))
        start += length
    return torch.cat(outs)


def module(cp_group=None) -> SDPACoreAttention:
    cp_size = 1 if cp_group is None else cp_group.size()
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=D, context_parallel_size=cp_size)
    return SDPACoreAttention(config, layer_number=1, attn_mask_type=None, pg_collection=SimpleNamespace(cp=cp_group))


def packed_params(seqlens):
    cu = torch.tensor([0] + seqlens).cumsum(0).to(torch.int32)
    return SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(seqlens))


def qkv(total, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, N_HEADS, D, generator=gen, dtype=dtype),
            torch.randn(total, N_GROUPS, D, generator=gen, dtype=dtype),
            torch.randn(total, N_GROUPS, D, generator=gen, dtype=dtype))


def test_packed_matches_naive_per_sequence_attention():
    seqlens = [5, 1, 12, 7]
    q, k, v = qkv(sum(seqlens))
    out = module()(q, k, v, None, packed_seq_params=packed_params(seqlens))
    expect = naive_packed(q, k, v, seqlens, 1 / math.sqrt(D))
    assert out.shape == (sum(seqlens), N_HEADS * D)
    torch.testing.assert_close(out.view_as(q), expect, rtol=1e-10, atol=1e-10)
    # tokens of one sequence never see another's: changing sequence 0 leaves the others alone
    q2 = q.clone()
    k2 = k.clone()
    k2[:5] += 1.0
    out2 = module()(q2, k2, v, None, packed_seq_params=packed_params(seqlens))
    assert torch.equal(out2[5:], out[5:]) and not torch.equal(out2[:5], out[:5])


def test_padded_sbhd_matches_naive_with_right_padding():
    lengths = [6, 3]
    s, b = max(lengths), len(lengths)
    q, k, v = qkv(s * b, seed=1)
    q, k, v = (x.view(s, b, *x.shape[1:]) for x in (q, k, v))
    out = module()(q, k, v, None).view(s, b, N_HEADS, D)
    for i, length in enumerate(lengths):
        expect = naive_causal(q[:length, i], k[:length, i], v[:length, i], 1 / math.sqrt(D))
        torch.testing.assert_close(out[:length, i], expect, rtol=1e-10, atol=1e-10)
    # megatron's explicit mask (True = masked out) gives the same on real tokens
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[1, :, :, 3:] = True
    masked = module()(q, k, v, pad).view(s, b, N_HEADS, D)
    torch.testing.assert_close(masked[:3, 1], out[:3, 1], rtol=1e-10, atol=1e-10)


def test_cp_local_index_is_megatrons_load_balanced_layout():
    # one sequence of 8 tokens, cp=2 -> 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_local_index([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_local_index([8], 2, 1).tolist() == [2, 3, 4, 5]
    assert cp_local_index([4, 8], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="multiple of 2\\*context_parallel_size=4"):
        cp_local_index([6], 2, 0)


SEQLENS_CP = [8, 4, 12]


def cp_worker(rank: int, group, *, make_module=None, seed: int = 3) -> dict:
    """One CP rank's output and q/k/v gradients under a fixed random weighting of the output."""
    q, k, v = qkv(sum(SEQLENS_CP), seed=seed)
    idx = cp_local_index(SEQLENS_CP, 2, rank)
    ql, kl, vl = (x[idx].clone().requires_grad_() for x in (q, k, v))
    attn = (make_module or module)(cp_group=group)
    out = attn(ql, kl, vl, None, packed_seq_params=packed_params(SEQLENS_CP))
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(sum(SEQLENS_CP), N_HEADS * D, generator=gen, dtype=q.dtype)[idx]
    (out * weight).sum().backward()
    return {"idx": idx, "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}


def _cp_worker(rank: int, group) -> dict:
    return cp_worker(rank, group)


def assert_cp_ranks_match(ranks: list[dict], reference, seed: int = 3) -> None:
    """The CP ranks' outputs and gradients against reference(q, k, v) -> [total, n*d] on one rank."""
    total = sum(SEQLENS_CP)
    q, k, v = (x.requires_grad_() for x in qkv(total, seed=seed))
    expect = reference(q, k, v)
    weight = torch.randn(total, N_HEADS * D, generator=torch.Generator().manual_seed(7), dtype=q.dtype)
    (expect * weight).sum().backward()
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for got in ranks:
        idx = got["idx"]
        torch.testing.assert_close(got["out"], expect[idx].detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got["dq"], q.grad[idx], rtol=1e-10, atol=1e-10)
        # each rank's K/V feed both ranks' queries: its gradient already sums both uses
        dk[idx] += got["dk"]
        dv[idx] += got["dv"]
    torch.testing.assert_close(dk, k.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, v.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(120)
def test_context_parallel_on_two_gloo_ranks_matches_whole_sequence_attention(tmp_path):
    from tests.test_megatron_parallel import run_gloo_ranks

    ranks = run_gloo_ranks(_cp_worker, tmp_path)
    scale = 1 / math.sqrt(D)
    assert_cp_ranks_match(ranks, lambda q, k, v: naive_packed(q, k, v, SEQLENS_CP, scale).reshape(len(q), -1))
