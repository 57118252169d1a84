"""Tensor, context, pipeline and data parallelism of the megatron trainer on ONE GPU
(`bash .ci/gpu tests/test_megatron_gpu_parallel.py`).

Every layout is driven as the driver's TrainerGroup drives a rank group
(roles.trainer.group): each rank gets its data-parallel rank's share of the batch
(roles.trainer.sharding.plan_forward / plan_train, cut by take_rows), and the output ranks'
results are put back in batch order by sharding.put_rows. With dp size 1 the share is the
whole batch. DP2 splits it: rows 0, 3 and rows 1, 2 (balanced by tokens), one train
mini-batch of 2 rows per rank divided by the whole mini-batch's counts; megatron's DDP SUMS
the two ranks' gradients (roles.trainer.megatron.core) and the metrics are summed over dp.

NCCL refuses two ranks on one GPU, so the multi-rank runs use gloo, which takes CUDA tensors
for all_reduce, broadcast and all_gather (through the host). Every collective of TP2
(megatron's tensor-parallel layers, our vocab-parallel log-probs, the weight gather), of CP2
(K/V all-gather, row reassembly, the grad all-reduce over dp x cp) and of PP2 (the
cross-stage weight export, the metric broadcast, the tied embedding's grad all-reduce, the
grad norm over the model-parallel group) is one of those. Harness differences from a real
run, all here only:
  - megatron's DDP groups its grad all-reduces with torch's _coalescing_manager, which gloo
    does not run on CUDA tensors; the harness replaces it by a plain sequence of the same
    all-reduces (the same sums);
  - the optimizer is not the distributed one (its reduce-scatter has no gloo CUDA path);
  - PP: gloo has no CUDA send/recv, so `_host_staged_p2p` stands in for NCCL's
    point-to-point ops, and only for them. megatron-core 0.19.2 sends every pipeline
    message through `torch.distributed.batch_isend_irecv` (p2p_communication.py: the shape
    exchange of variable sequence lengths, and `_batched_p2p_ops` under its default
    batch_p2p_comm=True; the unbatched `_p2p_ops` and ring exchange are off), so that one
    function is replaced. The stand-in copies each tensor to the host, sends it with gloo's
    CPU isend/irecv to the same peer and tag, and copies it into megatron's CUDA receive
    buffer on wait(). What differs from NCCL: the bytes go GPU -> host -> host -> GPU, the
    host blocks on the copies (NCCL's group call is stream-ordered and overlaps), and the
    ops of one batch are not one fused group call. What it keeps: the schedule, which
    tensor goes to which stage and when, shapes and dtypes. NCCL p2p itself has not run.
float32 throughout, so the parallel runs must equal one rank to float32 rounding. PP2 runs on
a checkpoint with tied embeddings (as Qwen3-4B: the last stage holds a copy of the
embedding, kept equal by megatron's embedding group), against a one-rank run of the same
checkpoint; PP2 x CP2 (4 processes) on the untied one.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from runtime.rendezvous import host_store

pytestmark = pytest.mark.gpu

megatron = pytest.importorskip("megatron.core") if torch.cuda.is_available() else None

# `tied`: the layout runs on the tied-embeddings checkpoint and is compared with "ref_tied".
# The PP layouts pack the batch (sequences of 11, 5, 9, 5 tokens) into 2 micro-batches where
# the references run 1, so the pipeline reaches its 1F1B steady state (the loss is divided by
# the whole mini-batch's counts, so the split changes only rounding).
LAYOUTS = {"ref": dict(world=1), "tp2": dict(world=2, tensor_model_parallel_size=2),
           "cp2": dict(world=2, context_parallel_size=2),
           "ref_tied": dict(world=1, tied=True),
           "pp2": dict(world=2, pipeline_model_parallel_size=2, tied=True, max_tokens_per_gpu=16),
           "pp2cp2": dict(world=4, pipeline_model_parallel_size=2, context_parallel_size=2, max_tokens_per_gpu=8),
           "dp2": dict(world=2)}  # data parallelism: what is left of the world after tp, cp and pp
PARALLEL = ["tp2", "cp2", "pp2", "pp2cp2", "dp2"]
RUN_DEADLINE_S = 120  # every layout's processes, together


def _config(ckpt: str, **over) -> dict:
    from tests.test_megatron_gpu import trainer_config

    return trainer_config(ckpt, dtype="float32", use_distributed_optimizer=False, **over)


@contextlib.contextmanager
def _sequential(group=None, device=None, async_ops=False):
    yield None  # the all-reduces inside run one by one (synchronous), see the module docstring


class _HostStaged:
    """A gloo CPU isend/irecv of a host copy; wait() lands a received copy in the CUDA buffer."""

    def __init__(self, work, host: torch.Tensor, into: torch.Tensor | None):
        self.work, self.host, self.into = work, host, into

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        if self.into is not None:
            with torch.no_grad():  # megatron's receive buffers are leaves that require grad
                self.into.copy_(self.host)
        return True


def _host_staged_p2p() -> dict[str, int]:
    """Replace torch.distributed.batch_isend_irecv, megatron's one p2p entry point here, by
    the CPU-staged stand-in for NCCL's p2p (module docstring); returns its message counts."""
    import torch.distributed as dist

    counts = {"sent": 0, "received": 0}

    def batch_isend_irecv(p2p_op_list):
        works = []
        for op in p2p_op_list:  # P2POp: op (dist.isend / dist.irecv), tensor, peer (global rank), group, tag
            if op.op is dist.isend:
                host = op.tensor.detach().cpu().contiguous()
                works.append(_HostStaged(dist.isend(host, dst=op.peer, group=op.group, tag=op.tag), host, None))
                counts["sent"] += 1
            elif op.op is dist.irecv:
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                works.append(_HostStaged(dist.irecv(host, src=op.peer, group=op.group, tag=op.tag), host, op.tensor))
                counts["received"] += 1
            else:
                raise ValueError(f"unexpected p2p op {op.op}")
        return works

    dist.batch_isend_irecv = batch_isend_irecv
    return counts


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
    torch.set_num_threads(2)  # up to 14 processes share the machine's cores
    p2p = None
    if world > 1:
        from roles.trainer.distributed import init_from_env

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank))
        init_from_env("gloo")
        import megatron.core.distributed.param_and_grad_buffer as pgb

        pgb._coalescing_manager = _sequential
        if spec.get("pipeline_model_parallel_size", 1) > 1:
            p2p = _host_staged_p2p()
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
    tc = actor._core.tconfig  # the p2p path the stand-in replaces (module docstring)
    keep(p2p_path=dict(batch_p2p_comm=tc.batch_p2p_comm, ring=tc.use_ring_exchange_p2p,
                       overlap=tc.overlap_p2p_comm, variable_seq_lengths=tc.variable_seq_lengths))
    lp = actor.compute_log_probs(share)["log_probs"]
    keep(layout=lay, rows=rows, lp=lp)
    keep(weights={k: v.cpu() for k, v in actor.named_weights()})  # each TP / pipeline group gathers in step
    # the driver builds the train batch from the gathered log-probs, then the group splits it (_call_train)
    train = {**batch, "old_log_probs": _all_gathered(lay, rows, "lp", lp) + 0.01 * torch.randn(4, 6, generator=g),
             "advantages": torch.randn(4, 6, generator=g)}
    train_rows, minis = (plan[dp_rank] for plan in plan_train(train, dp_size, cfg["global_batch_size"],
                                                              cfg["loss_agg_mode"]))
    keep(train_rows=train_rows, minis=minis, train=actor.train(take_rows(train, train_rows), mini_batches=minis))
    keep(lp_after=actor.compute_log_probs(share)["log_probs"], p2p=p2p and dict(p2p))
    keep(weights_after={k: v.cpu() for k, v in actor.named_weights()}, checksum=actor.weights_checksum())
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
    return "ref_tied" if LAYOUTS[layout].get("tied") else "ref"


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


TIGHT = dict(rtol=0.0, atol=1e-4)  # float32; the ranks only reorder sums


def _check_shares(ref: dict, layout: str, ranks: list[dict], key: str) -> None:
    """Each last-stage rank's `key` over its share equals the reference's rows (TP peers
    compute the same rows; CP peers gather them), earlier stages return zeros (not output
    ranks: MegatronCore.forward_only); gathered as the group gathers, the whole reference."""
    for i, r in enumerate(ranks):
        if _last_stage(layout, i):
            torch.testing.assert_close(r[key], ref[key][r["rows"], :r[key].shape[1]], **TIGHT, msg=f"rank {i}")
        else:
            assert not r[key].any(), i
    torch.testing.assert_close(_gathered(ranks, key), ref[key], **TIGHT)


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


@pytest.mark.parametrize("layout", ["pp2", "pp2cp2"])
def test_pipeline_stages_talk_through_megatrons_batched_p2p(runs, layout):
    """The stand-in replaced the only p2p path megatron took: every stage sent and received
    (activations forward, gradients backward, each after its shape)."""
    from roles.trainer.megatron.packing import plan_packed

    spec = LAYOUTS[layout]
    assert len(plan_packed([11, 5, 9, 5], max_tokens=spec["max_tokens_per_gpu"] * spec.get("context_parallel_size", 1))
               ) == 2  # the layout's micro-batches (see LAYOUTS)
    _, ranks = _need(runs, layout, "p2p_path", "p2p")
    for i, r in enumerate(ranks):
        assert r["p2p_path"] == {"batch_p2p_comm": True, "ring": False, "overlap": False,
                                 "variable_seq_lengths": True}, i
        assert r["p2p"]["sent"] > 0 and r["p2p"]["received"] > 0, (i, r["p2p"])


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
            assert r[key][name] == pytest.approx(value, rel=1e-3, abs=1e-5), (i, name)
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
    torch.testing.assert_close(lp_after, ref["lp_after"], rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_critic(runs, layout):
    ref, ranks = _need(runs, layout, "values", "critic_train", "values_after")
    _check_shares(ref, layout, ranks, "values")
    _check_metrics(ref, layout, ranks, "critic_train")
    torch.testing.assert_close(_gathered(ranks, "values_after"), ref["values_after"], rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("layout", PARALLEL)
def test_gathered_hf_weights_are_the_checkpoint_and_follow_the_update(runs, layout, ckpt, tied_ckpt):
    """Rank 0 (which sends the weight sync and writes save_hf) gets every TP shard and every
    pipeline stage back as HF tensors, bit-identical to the checkpoint before the update."""
    from roles.trainer.megatron.env import load_hf_state

    ref, ranks = _need(runs, layout, "weights", "weights_after", "checksum", "save_hf")
    out = ranks[0]
    hf = load_hf_state(tied_ckpt if LAYOUTS[layout].get("tied") else ckpt)
    assert set(out["weights"]) == set(hf)
    for name, tensor in hf.items():  # shards all-gathered and stages broadcast back: bit-identical
        assert torch.equal(out["weights"][name], tensor.float()), name
    assert set(ref["weights_after"]) == set(hf)
    for name, tensor in ref["weights_after"].items():
        torch.testing.assert_close(out["weights_after"][name], tensor, rtol=0.0, atol=3e-4, msg=name)
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
