"""Tensor and context parallelism of the megatron trainer, the pure-torch parts, on the CPU:
vocab-parallel log-probs and entropy on 2 gloo ranks against the full-vocab computation
(values and gradients), the CP slicing of packed micro-batches and the reassembly of
per-row outputs (2 gloo ranks, with gradients), and the config's refusals.
The GPU side (megatron itself, TP2 / CP2 / PP2 against one rank) is in
tests/test_megatron_gpu_parallel.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from roles.trainer.megatron import MegatronTrainerConfig
from roles.trainer.megatron.cp import cp_slice, gather_rows
from roles.trainer.megatron.logprobs import vocab_parallel_log_probs, vocab_shard
from roles.trainer.megatron.packing import pack
from runtime.rendezvous import host_store

VOCAB, HIDDEN, ROWS = 23, 16, 37  # vocab 23 pads to 24 on 2 TP ranks: the last shard has a padding row


def run_gloo_ranks(target, tmp_path, world_size: int = 2, backend: str = "gloo") -> list[dict]:
    """target(rank, group) -> dict on `world_size` gloo processes (spawned: `target` must be
    importable); the dicts, by rank. `backend` "staged": tests/staged_collectives.py over gloo.
    Used by tests/test_megatron_attention.py, tests/test_megatron_export.py and
    tests/test_staged_collectives.py too."""
    ctx = mp.get_context("spawn")
    store = host_store("127.0.0.1", world_size)  # held until the ranks are done
    port = store.port
    paths = [str(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    procs = [ctx.Process(target=_entry, args=(target, r, world_size, port, paths[r], backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=90)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [torch.load(p) for p in paths]


def _entry(target, rank: int, world_size: int, port: int, path: str, backend: str) -> None:
    import torch.distributed as dist

    from roles.trainer.distributed import init_from_env
    from tests import staged_collectives

    staged_collectives.register()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    init_from_env(backend)
    try:
        torch.save(target(rank, dist.group.WORLD), path)
    finally:
        dist.destroy_process_group()


def _logits_inputs():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    targets[:3] = torch.tensor([0, 11, VOCAB - 1])  # ids on each shard's edges
    return hidden, weight, targets


def _reference(hidden, weight, targets, temperature=0.7):
    logits = (hidden @ weight.t()) / temperature
    lp = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    return lp, ent


def _tp_worker(rank: int, group) -> dict:
    hidden, weight, targets = _logits_inputs()
    padded = torch.cat([weight, weight.new_zeros(1, HIDDEN)])  # megatron's TP-padded vocab (24 rows)
    full_shard = padded.chunk(2)[rank].clone().requires_grad_()
    shard, start = vocab_shard(full_shard, vocab_size=VOCAB, tp_rank=rank)
    h = hidden.clone().requires_grad_()
    lp, ent = vocab_parallel_log_probs(h, shard, targets, vocab_start=start, temperature=0.7, chunk=8,
                                       with_entropy=True, group=group)
    (lp.sum() + 0.1 * ent.sum()).backward()
    with torch.no_grad():
        lp_nograd, ent_nograd = vocab_parallel_log_probs(hidden, shard, targets, vocab_start=start, temperature=0.7,
                                                         chunk=5, with_entropy=True, group=group)
    return {"lp": lp.detach(), "ent": ent.detach(), "dh": h.grad, "dw": full_shard.grad, "rows": len(shard),
            "lp_nograd": lp_nograd, "ent_nograd": ent_nograd}


@pytest.mark.timeout(120)
def test_vocab_parallel_log_probs_on_two_gloo_ranks_equal_the_full_vocab(tmp_path):
    hidden, weight, targets = (x.clone() for x in _logits_inputs())
    hidden.requires_grad_()
    weight.requires_grad_()
    ref_lp, ref_ent = _reference(hidden, weight, targets)
    (ref_lp.sum() + 0.1 * ref_ent.sum()).backward()
    ranks = run_gloo_ranks(_tp_worker, tmp_path)
    tol = dict(rtol=1e-5, atol=1e-5)  # the chunks compute in float32, as the trainer does
    assert [r["rows"] for r in ranks] == [12, 11]  # the padding row is cut from the last shard
    for r in ranks:  # every TP rank holds the same (replicated) results and the full hidden gradient
        torch.testing.assert_close(r["lp"].double(), ref_lp.detach(), **tol)
        torch.testing.assert_close(r["ent"].double(), ref_ent.detach(), **tol)
        torch.testing.assert_close(r["lp_nograd"].double(), ref_lp.detach(), **tol)
        torch.testing.assert_close(r["ent_nograd"].double(), ref_ent.detach(), **tol)
        torch.testing.assert_close(r["dh"], hidden.grad, **tol)
    dw = torch.cat([ranks[0]["dw"], ranks[1]["dw"]])
    torch.testing.assert_close(dw[:VOCAB], weight.grad, **tol)
    assert dw[VOCAB:].eq(0).all()


def test_vocab_parallel_log_probs_without_a_group_is_the_full_vocab_computation():
    hidden, weight, targets = (x.clone().requires_grad_() if x.is_floating_point() else x for x in _logits_inputs())
    lp, ent = vocab_parallel_log_probs(hidden, weight, targets, vocab_start=0, temperature=0.7, chunk=8,
                                       with_entropy=True)
    ref_lp, ref_ent = _reference(hidden, weight, targets)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    (lp.sum() + 0.1 * ent.sum()).backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (ref_lp.sum() + 0.1 * ref_ent.sum()).backward()
    torch.testing.assert_close(gh, hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, weight.grad, rtol=1e-5, atol=1e-5)
    empty, _ = vocab_parallel_log_probs(hidden[:0], weight, targets[:0], vocab_start=0, temperature=1.0, chunk=8,
                                        with_entropy=False)
    assert empty.shape == (0,)  # a CP rank may hold no response row of a micro-batch


def _cp_batch():
    g = torch.Generator().manual_seed(2)
    prompt_lens, response_lens = torch.tensor([5, 3, 4]), torch.tensor([6, 2, 3])
    return {"input_ids": torch.randint(1, 50, (3, 11), generator=g), "prompt_lens": prompt_lens,
            "response_lens": response_lens, "loss_mask": torch.ones(3, 6)}


def _cp_mb(cp: int):
    from roles.trainer.batching import sequences

    batch = _cp_batch()
    return pack(sequences(batch), batch, [0, 1, 2], ("loss_mask",), pad_multiple=2 * cp)


def test_cp_slices_cover_the_padded_micro_batch_and_each_row_once():
    mb = _cp_mb(2)
    assert mb.cu_seqlens.tolist() == [0, 12, 20, 28]  # 11, 5, 7 tokens padded to multiples of 4
    pieces = [cp_slice(mb, 2, r) for r in range(2)]
    assert sorted(torch.cat([p.index for p in pieces]).tolist()) == list(range(mb.num_tokens))
    assert all(len(p.index) == mb.num_tokens // 2 for p in pieces)
    held = torch.cat([p.index[p.local_rows] for p in pieces])
    assert sorted(held.tolist()) == sorted(mb.rows.tolist())
    for p in pieces:  # the targets a rank predicts are the micro-batch's at those rows
        lookup = dict(zip(mb.rows.tolist(), mb.targets.tolist()))
        assert p.targets.tolist() == [lookup[i] for i in p.index[p.local_rows].tolist()]
        assert torch.equal(p.input_ids, mb.input_ids[p.index]) and torch.equal(p.position_ids, mb.position_ids[p.index])
    one = cp_slice(_cp_mb(1), 1, 0)
    assert torch.equal(one.index, torch.arange(_cp_mb(1).num_tokens)) and torch.equal(one.local_rows, _cp_mb(1).rows)


def _cp_gather_worker(rank: int, group) -> dict:
    mb = _cp_mb(2)
    piece = cp_slice(mb, 2, rank)
    # a per-token "output": a function of the global position, so the reassembled order is checkable
    values = (piece.index[piece.local_rows].double() * 10).requires_grad_()
    rows = gather_rows(values, piece, group)
    weight = torch.arange(len(rows), dtype=torch.float64) + 1
    (rows * weight).sum().backward()  # the same (replicated) loss on both ranks
    return {"rows": rows.detach(), "grad": values.grad, "held": piece.index[piece.local_rows]}


@pytest.mark.timeout(120)
def test_cp_gather_puts_rows_back_in_order_and_each_gradient_on_its_rank(tmp_path):
    mb = _cp_mb(2)
    ranks = run_gloo_ranks(_cp_gather_worker, tmp_path)
    expect = mb.rows.double() * 10
    weight = {int(pos): k + 1.0 for k, pos in enumerate(mb.rows)}
    for r in ranks:
        torch.testing.assert_close(r["rows"], expect, rtol=0, atol=0)
        # own rows get their weight once: no sum over CP ranks (DDP sums over them later)
        assert r["grad"].tolist() == [weight[int(p)] for p in r["held"]]


def test_parallel_sizes_validated_pipeline_accepted():
    from tests.test_megatron_parts import BASE as base
    cfg = MegatronTrainerConfig(**base, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                context_parallel_size=2)
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size) == (2, 2, 2)
    for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        with pytest.raises(ValueError, match=f"{field}=0, expected >= 1"):
            MegatronTrainerConfig(**base, **{field: 0})
