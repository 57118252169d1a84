"""Tensor, context and pipeline parallelism of the megatron trainer on ONE GPU
(`bash .ci/gpu tests/test_megatron_gpu_parallel.py`).

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
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

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
           "pp2cp2": dict(world=4, pipeline_model_parallel_size=2, context_parallel_size=2, max_tokens_per_gpu=8)}
PARALLEL = ["tp2", "cp2", "pp2", "pp2cp2"]
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
    import torch.distributed as dist

    spec = dict(LAYOUTS[layout])
    world = spec.pop("world")
    spec.pop("tied", None)  # the fixture picked the checkpoint
    torch.set_num_threads(2)  # up to 12 processes share the machine's cores
    p2p = None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import megatron.core.distributed.param_and_grad_buffer as pgb

        pgb._coalescing_manager = _sequential
        if spec.get("pipeline_model_parallel_size", 1) > 1:
            p2p = _host_staged_p2p()
    from transformers import AutoConfig

    from roles.trainer.megatron import MegatronActorTrainer, MegatronCriticTrainer
    from roles.trainer.sharding import plan_train
    from tests.test_megatron_gpu import make_batch

    cfg = _config(ckpt, **spec)
    batch = make_batch(AutoConfig.from_pretrained(ckpt).vocab_size)
    minis = plan_train(batch, 1, cfg["global_batch_size"], cfg["loss_agg_mode"])[1][0]
    g = torch.Generator().manual_seed(1)
    actor = MegatronActorTrainer(cfg)
    actor.onload(["params", "grads", "optimizer"])
    tc = actor._core.tconfig  # the p2p path the stand-in replaces (module docstring)
    keep(p2p_path=dict(batch_p2p_comm=tc.batch_p2p_comm, ring=tc.use_ring_exchange_p2p,
                       overlap=tc.overlap_p2p_comm, variable_seq_lengths=tc.variable_seq_lengths))
    lp = actor.compute_log_probs(batch)["log_probs"]
    keep(layout=actor.rank_layout(), lp=lp)
    keep(weights={k: v.cpu() for k, v in actor.named_weights()})  # each TP / pipeline group gathers in step
    # before the last pipeline stage lp is zeros (not an output rank); only the last stage reads old_log_probs
    train = {**batch, "old_log_probs": lp + 0.01 * torch.randn(lp.shape, generator=g),
             "advantages": torch.randn(4, 6, generator=g)}
    keep(train=actor.train(train, mini_batches=minis))
    keep(lp_after=actor.compute_log_probs(batch)["log_probs"], p2p=p2p and dict(p2p))
    keep(weights_after={k: v.cpu() for k, v in actor.named_weights()}, checksum=actor.weights_checksum())
    keep(save_hf=actor.save_hf(f"{os.path.dirname(ckpt)}/{layout}.{rank}.hf"))  # rank 0 writes; its peers gather
    actor.offload(["params", "grads", "optimizer"])
    critic = MegatronCriticTrainer(_config(ckpt, keep_ref=False, **spec))
    critic.onload(["params", "grads", "optimizer"])
    values = critic.compute_values(batch)["values"]
    keep(values=values)
    critic_train = {**batch, "old_values": values, "returns": torch.randn(4, 6, generator=g)}
    keep(critic_train=critic.train(critic_train, mini_batches=minis))
    keep(values_after=critic.compute_values(batch)["values"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    procs, paths = [], {}
    for layout, spec in LAYOUTS.items():
        port = _free_port()
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


def _coords(layout: str, rank: int) -> dict[str, int]:
    """(tp, cp, pp) rank of a global rank in megatron's order tp, cp, dp, pp (dp size 1 here)."""
    spec = LAYOUTS[layout]
    tp, cp = spec.get("tensor_model_parallel_size", 1), spec.get("context_parallel_size", 1)
    return {"tp": rank % tp, "cp": rank // tp % cp, "pp": rank // (tp * cp)}


def _last_stage(layout: str, rank: int) -> bool:
    return _coords(layout, rank)["pp"] == LAYOUTS[layout].get("pipeline_model_parallel_size", 1) - 1


def _output(layout: str, ranks: list[dict]) -> dict:
    """The output rank's results: TP rank 0, CP rank 0 on the last pipeline stage."""
    (out,) = [r for i, r in enumerate(ranks) if _last_stage(layout, i) and _coords(layout, i)["cp"] == 0
              and _coords(layout, i)["tp"] == 0]
    return out


TIGHT = dict(rtol=0.0, atol=1e-4)  # float32; the ranks only reorder sums


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_log_probs(runs, layout):
    ref, ranks = _need(runs, layout, "layout", "lp")
    for i, r in enumerate(ranks):
        c = _coords(layout, i)
        assert r["layout"] == {"dp_rank": 0, "dp_size": 1,
                               "is_output": c["tp"] == 0 and c["cp"] == 0 and _last_stage(layout, i)}, i
        if _last_stage(layout, i):  # TP peers compute the same rows; CP peers gather them
            torch.testing.assert_close(r["lp"], ref["lp"], **TIGHT)
        else:  # earlier pipeline stages are not output ranks (MegatronCore.forward_only)
            assert not r["lp"].any(), i


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


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_ppo_update(runs, layout):
    ref, ranks = _need(runs, layout, "train", "lp_after")
    for i, r in enumerate(ranks):  # every rank reports the metrics (PP: broadcast from the last stage)
        for key, value in ref["train"].items():
            assert r["train"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), (i, key)
    out = _output(layout, ranks)
    assert out["train"]["skipped_nonfinite"] == 0 and out["train"]["grad_norm"] > 0
    assert (out["lp_after"] - out["lp"]).abs().max() > 1e-3  # the update moved the policy
    # Adam divides by sqrt(v): near-zero gradients may move a weight by up to ~lr either way
    torch.testing.assert_close(out["lp_after"], ref["lp_after"], rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("layout", PARALLEL)
def test_parallel_ranks_equal_one_rank_critic(runs, layout):
    ref, ranks = _need(runs, layout, "values", "critic_train", "values_after")
    for i, r in enumerate(ranks):
        if _last_stage(layout, i):
            torch.testing.assert_close(r["values"], ref["values"], **TIGHT)
    out = _output(layout, ranks)
    for key, value in ref["critic_train"].items():
        assert out["critic_train"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    torch.testing.assert_close(out["values_after"], ref["values_after"], rtol=0.0, atol=2e-3)


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
        if c["cp"] != 0:
            assert r["checksum"] == {}, i
        elif c["pp"] == 0:
            assert r["checksum"] == out["checksum"], i
        else:
            assert r["checksum"] and r["checksum"].items() < out["checksum"].items(), i
    saved = load_hf_state(out["save_hf"]["path"])
    assert set(saved) == set(hf) and all(torch.equal(saved[k], out["weights_after"][k]) for k in hf)
