"""Tensor, context, pipeline and data parallelism of the megatron trainer on ONE GPU
(`bash .ci/gpu tests/test_megatron_gpu_parallel.py`).

Every layout is driven as the driver's TrainerGroup drives a rank group
(roles.trainer.group): each rank gets its data-parallel rank's share of the batch
(roles.trainer.sharding.plan_forward / plan_train, cut by take_rows), and the output ranks'
results are put back in batch order by sharding.put_rows. With dp size 1 the share is the
whole batch. DP2 splits it: rows 0, 3 and rows 1, 2 (balanced by tokens), one train
mini-batch of 2 rows per rank divided by the whole mini-batch's counts; megatron's DDP SUMS
the two ranks' gradients (roles.trainer.megatron.core) and the metrics are summed over dp.

NCCL refuses two ranks on one GPU, so the multi-rank runs use tests/staged_collectives.py:
a process-group backend that runs each collective and point-to-point op on the host over
gloo (stage to the CPU, the same op, copy back). megatron's own code runs unchanged on it:
the distributed optimizer's reduce-scatter of the grads and all-gather of the params under
torch's _coalescing_manager, the pipeline schedule's batch_isend_irecv (megatron-core
0.19.2 sends every pipeline message through it: p2p_communication.py, batch_p2p_comm=True
by default), the TP/CP/PP all-reduces and all-gathers. What differs from NCCL is said there
(bytes through the host, ops complete before they return, no stream ordering); NCCL itself
has not run here. The distributed optimizer is on, as in production (its main params and
Adam state sharded over dp).

Two precisions. float32 first, so the parallel runs must equal one rank to float32 rounding
(the fp32 layouts); then the production precision, bf16, where the attention takes the flash
varlen path (roles.trainer.megatron.attention) and the ranks equal one bf16 rank within bf16
rounding (the *_bf16 layouts, looser tolerances: BF16). PP2 runs on a checkpoint with tied
embeddings (as Qwen3-4B: the last stage holds a copy of the embedding, kept equal by
megatron's embedding group), against a one-rank run of the same checkpoint; PP2 x CP2
(4 processes) on the untied one.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from runtime.rendezvous import host_store

pytestmark = pytest.mark.gpu

megatron = pytest.importorskip("megatron.core") if torch.cuda.is_available() else None

# `tied`: the layout runs on the tied-embeddings checkpoint; `bf16`: in bfloat16. A layout is
# compared with the one-rank run of the same checkpoint and precision (_reference).
# The PP layouts pack the batch (sequences of 11, 5, 9, 5 tokens) into 2 micro-batches where
# the references run 1, so the pipeline reaches its 1F1B steady state (the loss is divided by
# the whole mini-batch's counts, so the split changes only rounding).
LAYOUTS = {"ref": dict(world=1), "tp2": dict(world=2, tensor_model_parallel_size=2),
           "cp2": dict(world=2, context_parallel_size=2),
           "ref_tied": dict(world=1, tied=True),
           "pp2": dict(world=2, pipeline_model_parallel_size=2, tied=True, max_tokens_per_gpu=16),
           "pp2cp2": dict(world=4, pipeline_model_parallel_size=2, context_parallel_size=2, max_tokens_per_gpu=8),
           "dp2": dict(world=2),  # data parallelism: what is left of the world after tp, cp and pp
           "ref_bf16": dict(world=1, bf16=True), "ref_tied_bf16": dict(world=1, tied=True, bf16=True),
           "dp2_bf16": dict(world=2, bf16=True), "tp2_bf16": dict(world=2, tensor_model_parallel_size=2, bf16=True),
           "cp2_bf16": dict(world=2, context_parallel_size=2, bf16=True),
           "pp2_bf16": dict(world=2, pipeline_model_parallel_size=2, tied=True, max_tokens_per_gpu=16, bf16=True)}
PARALLEL = ["tp2", "cp2", "pp2", "pp2cp2", "dp2", "dp2_bf16", "tp2_bf16", "cp2_bf16", "pp2_bf16"]
RUN_DEADLINE_S = 240  # every layout's processes, together

# Tolerances against the one-rank run: float32 (the ranks only reorder sums), and bfloat16,
# where TP's partial sums and CP's split attention round differently (the bf16 comparison of
# the two backends in tests/test_megatron_gpu.py allows the same).
TOL = {False: dict(share=dict(rtol=0.0, atol=1e-4), metric=dict(rel=1e-3, abs=1e-5), after=dict(rtol=0.0, atol=2e-3),
                   weights=dict(rtol=0.0, atol=3e-4)),
       True: dict(share=dict(rtol=0.0, atol=0.05), metric=dict(rel=0.05, abs=2e-3), after=dict(rtol=0.0, atol=0.08),
                  # Adam's first step moves a near-zero-gradient weight by up to lr (1e-4) either way,
                  # then each side rounds to bf16 (an ulp is 2^-7 of the value at most)
                  weights=dict(rtol=1.6e-2, atol=5e-4))}


def _tol(layout: str, kind: str) -> dict:
    return TOL[bool(LAYOUTS[layout].get("bf16"))][kind]


def _config(ckpt: str, **over):
    """The production layout: the distributed optimizer on (the default)."""
    from roles.trainer.megatron import MegatronTrainerConfig
    from tests.test_megatron_gpu import trainer_config

    bf16 = over.pop("bf16", False)
    return MegatronTrainerConfig.from_dict(trainer_config(ckpt, dtype="bfloat16" if bf16 else "float32", **over))


def _worker(layout: str, rank: int, port: int, ckpt: str, path: str) -> None:
    """Each step's results are saved as soon as they exist, and the first error with them:
    a failure or a hang late in the run still leaves the earlier comparisons checkable."""
    import faulthandler
    import traceback

    import torch.distributed as dist

    faulthandler.dump_traceback_later(RUN_DEADLINE_S - 15)  # a hang prints where each rank waits, before the kill
    out: dict = {}
    try:
        _steps(layout, rank, port, ckpt, lambda **kw: (out.update(kw), torch.save(out, path)))
    except BaseException:
        out["error"] = traceback.format_exc()
        torch.save(out, path)
        raise
    finally:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.destroy_process_group()


def _steps(layout: str, rank: int, port: int, ckpt: str, keep) -> None:
    spec = dict(LAYOUTS[layout])
    world = spec.pop("world")
    spec.pop("tied", None)  # the fixture picked the checkpoint
    torch.set_num_threads(1)  # 24 processes share the machine's cores
    if world > 1:
        from roles.trainer.distributed import init_from_env
        from tests import staged_collectives

        staged_collectives.register()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        init_from_env(staged_collectives.BACKEND)
    from transformers import AutoConfig

    from roles.trainer.megatron import MegatronActorTrainer, MegatronCriticTrainer
    from roles.trainer.sharding import plan_forward, plan_train, take_rows
    from tests.test_megatron_gpu import make_batch

    cfg = _config(ckpt, **spec)
    batch = make_batch(AutoConfig.from_pretrained(ckpt).vocab_size)
    g = torch.Generator().manual_seed(1)  # the same draws on every rank (and in the references)
    actor = MegatronActorTrainer(cfg)
    actor.onload(["params", "grads", "optimizer"])
    lay = actor.rank_layout()
    dp_rank, dp_size = lay["dp_rank"], lay["dp_size"]
    rows = plan_forward(batch, dp_size)[dp_rank]  # TrainerGroup._call_sharded's share
    share = take_rows(batch, rows)
    core, tc = actor._core, actor._core.tconfig  # megatron's p2p path (module docstring)
    keep(p2p_path=dict(batch_p2p_comm=tc.batch_p2p_comm, ring=tc.use_ring_exchange_p2p,
                       overlap=tc.overlap_p2p_comm, variable_seq_lengths=tc.variable_seq_lengths))
    from roles.trainer.megatron.attention import varlen_usable

    keep(optimizer=sorted({type(opt).__name__ for opt in core._optimizers()}),  # under megatron's ChainedOptimizer
         varlen=varlen_usable(next(core.module.parameters())[None, None]))
    lp = actor.compute_log_probs(share)["log_probs"]
    keep(layout=lay, rows=rows, lp=lp)
    keep(weights={k: v.cpu() for k, v in actor.named_weights()})  # each TP / pipeline group gathers in step
    # the driver builds the train batch from the gathered log-probs, then the group splits it (_call_train)
    train = {**batch, "old_log_probs": _all_gathered(lay, rows, "lp", lp) + 0.01 * torch.randn(4, 6, generator=g),
             "advantages": torch.randn(4, 6, generator=g)}
    train_rows, minis = (plan[dp_rank] for plan in plan_train(train, dp_size, cfg.global_batch_size,
                                                              cfg.loss_agg_mode))
    keep(train_rows=train_rows, minis=minis, train=actor.train(take_rows(train, train_rows), mini_batches=minis))
    keep(lp_after=actor.compute_log_probs(share)["log_probs"],
         optimizer_numel=sum(t.numel() for t in core._optimizer_tensors()))  # main params and Adam moments
    keep(weights_after={k: v.cpu() for k, v in actor.named_weights()}, checksum=actor.weights_checksum())
    # the last stage's copy of a tied embedding drifts from stage 0's (as a missed all-reduce of
    # their grads would leave it): the checksums must show it
    copy = core.module.output_layer.weight if core.last_stage and core.pp_size > 1 and core.shape.tied_embeddings \
        else None
    saved = None if copy is None else copy.detach().clone()
    if copy is not None:
        with torch.no_grad():
            copy[1] += 0.5  # row 1: a token id on TP rank 0's shard
    keep(checksum_diverged=actor.weights_checksum())
    if copy is not None:
        with torch.no_grad():
            copy.copy_(saved)
    keep(save_hf=actor.save_hf(f"{os.path.dirname(ckpt)}/{layout}.{rank}.hf"))  # rank 0 writes; its peers gather
    actor.offload(["params", "grads", "optimizer"])
    critic = MegatronCriticTrainer(_config(ckpt, keep_ref=False, **spec))
    critic.onload(["params", "grads", "optimizer"])
    values = critic.compute_values(share)["values"]
    keep(values=values)
    critic_train = {**batch, "old_values": _all_gathered(lay, rows, "values", values),
                    "returns": torch.randn(4, 6, generator=g)}
    keep(critic_train=critic.train(take_rows(critic_train, train_rows), mini_batches=minis))
    keep(values_after=critic.compute_values(share)["values"])
    from tests.staged_collectives import COUNTS

    keep(collectives=dict(COUNTS))  # empty on one rank (its world is NCCL's)


def _all_gathered(rank_layout: dict, rows: list[int], key: str, value: torch.Tensor) -> torch.Tensor:
    """What the driver gets back from the group for `key`: every rank's result exchanged
    (all_gather_object over the world), then _gathered, in every rank."""
    import torch.distributed as dist

    mine = {"layout": rank_layout, "rows": rows, key: value}
    if dist.get_world_size() == 1:
        return _gathered([mine], key)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return _gathered(everyone, key)


def _gathered(ranks: list[dict], key: str) -> torch.Tensor:
    """TrainerGroup's result of a batch endpoint: the output rank of each dp rank
    (TrainerGroup._outputs), its rows put back in batch order (sharding.put_rows, as
    TrainerGroup._call_sharded combines them)."""
    from roles.trainer.sharding import put_rows

    outputs = sorted((r for r in ranks if r["layout"]["is_output"]), key=lambda r: r["layout"]["dp_rank"])
    assert [r["layout"]["dp_rank"] for r in outputs] == list(range(ranks[0]["layout"]["dp_size"])), \
        [r["layout"] for r in ranks]
    return put_rows([(r["rows"], {key: r[key]}) for r in outputs], sum(len(r["rows"]) for r in outputs))[key]


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    """The tiny Qwen3 of the `ckpt` fixture with tied input and output embeddings."""
    from ppo.tiny_model import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_tied")), seed=0, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def runs(ckpt, tied_ckpt, tmp_path_factory) -> dict[str, list[dict]]:
    """Every layout's ranks, run at once (separate processes: one parallel state each)."""
    tmp = tmp_path_factory.mktemp("parallel")
    ctx = mp.get_context("spawn")
    procs, paths, stores = [], {}, []  # the stores serve until the ranks are done
    for layout, spec in LAYOUTS.items():
        stores.append(host_store("127.0.0.1", spec["world"]))
        port = stores[-1].port
        paths[layout] = [str(tmp / f"{layout}.{r}.pt") for r in range(spec["world"])]
        path = tied_ckpt if spec.get("tied") else ckpt
        procs += [ctx.Process(target=_worker, args=(layout, r, port, path, paths[layout][r]))
                  for r in range(spec["world"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RUN_DEADLINE_S
    try:
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return {layout: [torch.load(p) if os.path.exists(p) else {"error": "no result (killed or died at start)"}
                     for p in ps] for layout, ps in paths.items()}


def _reference(layout: str) -> str:
    spec = LAYOUTS[layout]
    return "ref" + ("_tied" if spec.get("tied") else "") + ("_bf16" if spec.get("bf16") else "")


def _need(runs, layout: str, *keys: str) -> tuple[dict, list[dict]]:
    """The 1-rank reference of `layout` and its ranks, failing with the recorded error when
    a rank did not get as far as `keys`."""
    ref = _reference(layout)
    for name, r in [(ref, runs[ref][0])] + [(f"{layout} rank {i}", r) for i, r in enumerate(runs[layout])]:
        missing = [k for k in keys if k not in r]
        assert not missing, f"{name} has no {missing}: {r.get('error', 'stopped early')}"
    return runs[ref][0], runs[layout]


AXES = ("tp", "cp", "dp", "pp")  # megatron's rank order, fastest first


def _sizes(layout: str) -> dict[str, int]:
    spec = LAYOUTS[layout]
    tp, cp = spec.get("tensor_model_parallel_size", 1), spec.get("context_parallel_size", 1)
    pp = spec.get("pipeline_model_parallel_size", 1)
    return {"tp": tp, "cp": cp, "dp": spec["world"] // (tp * cp * pp), "pp": pp}


def _coords(layout: str, rank: int) -> dict[str, int]:
    """(tp, cp, dp, pp) rank of a global rank, in megatron's order tp, cp, dp, pp."""
    out, stride = {}, 1
    for axis in AXES:
        out[axis] = rank // stride % _sizes(layout)[axis]
        stride *= _sizes(layout)[axis]
    return out


def _rank(layout: str, coords: dict[str, int]) -> int:
    """The global rank at `coords` (the inverse of _coords)."""
    rank, stride = 0, 1
    for axis in AXES:
        rank += coords[axis] * stride
        stride *= _sizes(layout)[axis]
    return rank


def _last_stage(layout: str, rank: int) -> bool:
    return _coords(layout, rank)["pp"] == _sizes(layout)["pp"] - 1


def _is_output(layout: str, rank: int) -> bool:
    """The output rank of its dp rank: TP rank 0, CP rank 0 on the last pipeline stage."""
    c = _coords(layout, rank)
    return c["tp"] == 0 and c["cp"] == 0 and _last_stage(layout, rank)


def _check_shares(ref: dict, layout: str, ranks: list[dict], key: str) -> None:
    """Each last-stage rank's `key` over its share equals the reference's rows (TP peers
    compute the same rows; CP peers gather them), earlier stages return zeros (not output
    ranks: MegatronCore.forward_only); gathered as the group gathers, the whole reference."""
    tol = _tol(layout, "share")
    for i, r in enumerate(ranks):
        if _last_stage(layout, i):
            torch.testing.assert_close(r[key], ref[key][r["rows"], :r[key].shape[1]], **tol, msg=f"rank {i}")
        else:
            assert not r[key].any(), i
    torch.testing.assert_close(_gathered(ranks, key), ref[key], **tol)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_log_probs(runs, layout):
    ref, ranks = _need(runs, layout, "layout", "rows", "lp")
    sizes = _sizes(layout)
    for i, r in enumerate(ranks):
        c = _coords(layout, i)
        assert r["layout"] == {"dp_rank": c["dp"], "dp_size": sizes["dp"], "is_output": _is_output(layout, i)}, i
        if sizes["dp"] > 1:  # a real split: each dp rank got part of the batch
            assert 0 < len(r["rows"]) < len(ref["rows"]), (i, r["rows"])
    _check_shares(ref, layout, ranks, "lp")


@pytest.mark.parametrize("layout", PARALLEL)
def test_production_optimizer_and_attention_ran(runs, layout):
    """Every rank ran megatron's distributed optimizer (main params sharded over dp: a dp2
    rank holds about half of the one-rank's, padding aside), its grads reduce-scattered and
    its params all-gathered through the staged backend; bf16 ranks took the flash varlen
    attention."""
    ref, ranks = _need(runs, layout, "optimizer", "optimizer_numel", "collectives")
    bf16 = bool(LAYOUTS[layout].get("bf16"))
    assert ref["optimizer"] == ["DistributedOptimizer"] and ref["varlen"] == bf16
    for i, r in enumerate(ranks):
        assert r["optimizer"] == ["DistributedOptimizer"] and r["varlen"] == bf16, (i, r["optimizer"], r["varlen"])
        assert r["collectives"].get("reduce_scatter_tensor", 0) > 0, (i, r["collectives"])
        assert r["collectives"].get("allgather_into_tensor", 0) > 0, (i, r["collectives"])
        if _sizes(layout)["dp"] > 1:
            assert r["optimizer_numel"] < 0.6 * ref["optimizer_numel"], (i, r["optimizer_numel"], ref["optimizer_numel"])


@pytest.mark.parametrize("layout", ["pp2", "pp2cp2", "pp2_bf16"])
def test_pipeline_stages_talk_through_megatrons_batched_p2p(runs, layout):
    """megatron's only p2p path here, batch_isend_irecv, reached the staged backend's send and
    recv: every stage sent and received (activations forward, gradients backward, each after
    its shape)."""
    from roles.trainer.megatron.packing import plan_packed

    spec = LAYOUTS[layout]
    assert len(plan_packed([11, 5, 9, 5], max_tokens=spec["max_tokens_per_gpu"] * spec.get("context_parallel_size", 1))
               ) == 2  # the layout's micro-batches (see LAYOUTS)
    _, ranks = _need(runs, layout, "p2p_path", "collectives")
    for i, r in enumerate(ranks):
        assert r["p2p_path"] == {"batch_p2p_comm": True, "ring": False, "overlap": False,
                                 "variable_seq_lengths": True}, i
        assert r["collectives"].get("send", 0) > 0 and r["collectives"].get("recv", 0) > 0, (i, r["collectives"])


def _check_metrics(ref: dict, layout: str, ranks: list[dict], key: str) -> None:
    """Every rank reports the whole global batch's metrics (summed over the dp ranks' shares;
    PP: broadcast from the last stage), equal to the reference's; the output ranks (one per
    dp rank, the group returns the first) exactly equal (the rank contract). grad_norm is what
    catches a dp reduction that averages, or drops a rank's share: Adam's first step is
    nearly scale-invariant (~lr * sign(grad)), so the weights and log-probs after it hardly
    tell (the replicas' bit-identity in the weights test catches a missing all-reduce)."""
    for i, r in enumerate(ranks):
        assert set(r[key]) == set(ref[key]), i
        for name, value in ref[key].items():
            assert r[key][name] == pytest.approx(value, **_tol(layout, "metric")), (i, name)
    outputs = [r[key] for i, r in enumerate(ranks) if _is_output(layout, i)]
    assert all(m == outputs[0] for m in outputs), outputs
    assert outputs[0]["skipped_nonfinite"] == 0 and outputs[0]["grad_norm"] > 0


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_ppo_update(runs, layout):
    ref, ranks = _need(runs, layout, "train", "lp_after")
    for i, r in enumerate(ranks):  # the group's split: this dp rank's part of each mini-batch
        assert [m["num_samples"] for m in r["minis"]] == [len(r["train_rows"])], i
        assert r["minis"][0]["global_batch_size"] == len(ref["train_rows"]), i
    _check_metrics(ref, layout, ranks, "train")
    lp_after = _gathered(ranks, "lp_after")
    assert (lp_after - _gathered(ranks, "lp")).abs().max() > 1e-3  # the update moved the policy
    # Adam divides by sqrt(v): near-zero gradients may move a weight by up to ~lr either way
    torch.testing.assert_close(lp_after, ref["lp_after"], **_tol(layout, "after"))


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_critic(runs, layout):
    ref, ranks = _need(runs, layout, "values", "critic_train", "values_after")
    _check_shares(ref, layout, ranks, "values")
    _check_metrics(ref, layout, ranks, "critic_train")
    torch.testing.assert_close(_gathered(ranks, "values_after"), ref["values_after"], **_tol(layout, "after"))


@pytest.mark.parametrize("layout", PARALLEL)
def test_gathered_hf_weights_are_the_checkpoint_and_follow_the_update(runs, layout, ckpt, tied_ckpt):
    """Rank 0 (which sends the weight sync and writes save_hf) gets every TP shard and every
    pipeline stage back as HF tensors, bit-identical to the checkpoint before the update."""
    from roles.trainer.megatron.env import load_hf_state

    ref, ranks = _need(runs, layout, "weights", "weights_after", "checksum", "save_hf")
    out = ranks[0]
    hf = load_hf_state(tied_ckpt if LAYOUTS[layout].get("tied") else ckpt)
    assert set(out["weights"]) == set(hf)
    dtype = torch.bfloat16 if LAYOUTS[layout].get("bf16") else torch.float32
    for name, tensor in hf.items():  # shards all-gathered and stages broadcast back: bit-identical
        assert torch.equal(out["weights"][name], tensor.to(dtype)), name
    assert set(ref["weights_after"]) == set(hf)
    for name, tensor in ref["weights_after"].items():
        torch.testing.assert_close(out["weights_after"][name], tensor, **_tol(layout, "weights"), msg=name)
    assert set(out["checksum"]) == set(hf)
    for i, r in enumerate(ranks):  # dp 0, cp 0 gather: on stage 0 the whole model, later stages their own part
        c = _coords(layout, i)
        if c["dp"] != 0:  # a data-parallel replica: the weights of its dp-0 twin, bit for bit
            twin = ranks[_rank(layout, {**c, "dp": 0})]
            for key in ("weights", "weights_after"):
                assert set(r[key]) == set(twin[key]), (i, key)
                assert all(torch.equal(r[key][k], twin[key][k]) for k in twin[key]), (i, key)
        if c["cp"] != 0 or c["dp"] != 0:
            assert r["checksum"] == {}, i
        elif c["pp"] == 0:
            assert r["checksum"] == out["checksum"], i
        else:
            assert r["checksum"] and r["checksum"].items() < out["checksum"].items(), i
    saved = load_hf_state(out["save_hf"]["path"])
    assert set(saved) == set(hf) and all(torch.equal(saved[k], out["weights_after"][k]) for k in hf)


@pytest.mark.parametrize("layout", ["pp2", "pp2_bf16"])
def test_the_last_stages_copy_of_a_tied_embedding_is_checksummed(runs, layout):
    """With tied embeddings under PP the last stage holds its own copy of the embedding (the
    output layer). Its checksum reports it under the embedding's HF name, so the group's merge
    (what --check-weight-update-equal reads) sees a copy that drifted from stage 0's."""
    from roles.trainer.group import _merge_checksums

    _, ranks = _need(runs, layout, "checksum", "checksum_diverged")
    embed = "model.embed_tokens.weight"
    last = [r for i, r in enumerate(ranks) if _last_stage(layout, i) and r["checksum"]]
    assert last and all(r["checksum"].get(embed) == ranks[0]["checksum"][embed] for r in last)
    assert _merge_checksums([r["checksum"] for r in ranks]) == ranks[0]["checksum"]
    with pytest.raises(RuntimeError, match=embed):
        _merge_checksums([r["checksum_diverged"] for r in ranks])
