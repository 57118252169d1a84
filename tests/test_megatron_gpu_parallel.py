"""Tensor and context parallelism of the megatron trainer on ONE GPU (`bash .ci/gpu -k megatron`).

NCCL refuses two ranks on one GPU, so the 2-rank runs use gloo, which takes CUDA tensors for
all_reduce, broadcast and all_gather (through the host). Every collective of TP2 (megatron's
tensor-parallel layers, our vocab-parallel log-probs, the weight gather) and of CP2 (K/V
all-gather, row reassembly, the grad all-reduce over dp x cp) is one of those. Two harness
differences from a real run, both here only:
  - megatron's DDP groups its grad all-reduces with torch's _coalescing_manager, which gloo
    does not run on CUDA tensors; the harness replaces it by a plain sequence of the same
    all-reduces (the same sums);
  - the optimizer is not the distributed one (its reduce-scatter has no gloo CUDA path).
float32 throughout, so 2 ranks must equal 1 rank to float32 rounding. PP cannot run here
(gloo has no CUDA send/recv) and stays refused by the config.
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

LAYOUTS = {"ref": dict(world=1), "tp2": dict(world=2, tensor_model_parallel_size=2),
           "cp2": dict(world=2, context_parallel_size=2)}


def _config(ckpt: str, **over) -> dict:
    from tests.test_megatron_gpu import trainer_config

    return trainer_config(ckpt, dtype="float32", use_distributed_optimizer=False, **over)


@contextlib.contextmanager
def _sequential(group=None, device=None, async_ops=False):
    yield None  # the all-reduces inside run one by one (synchronous), see the module docstring


def _worker(layout: str, rank: int, port: int, ckpt: str, path: str) -> None:
    """Each step's results are saved as soon as they exist, and the first error with them:
    a failure or a hang late in the run still leaves the earlier comparisons checkable."""
    import traceback

    import torch.distributed as dist

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
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        import megatron.core.distributed.param_and_grad_buffer as pgb

        pgb._coalescing_manager = _sequential
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
    lp = actor.compute_log_probs(batch)["log_probs"]
    keep(layout=actor.rank_layout(), lp=lp)
    keep(weights={k: v.cpu() for k, v in actor.named_weights()})  # every rank of a TP group gathers
    train = {**batch, "old_log_probs": lp + 0.01 * torch.randn(lp.shape, generator=g),
             "advantages": torch.randn(4, 6, generator=g)}
    keep(train=actor.train(train, mini_batches=minis))
    keep(lp_after=actor.compute_log_probs(batch)["log_probs"])
    keep(weights_after={k: v.cpu() for k, v in actor.named_weights()}, checksum=actor.weights_checksum())
    keep(save_hf=actor.save_hf(f"{os.path.dirname(ckpt)}/{layout}.{rank}.hf"))  # rank 0 writes; its TP peer gathers
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
def runs(ckpt, tmp_path_factory) -> dict[str, list[dict]]:
    """Every layout's ranks, run at once (separate processes: one parallel state each)."""
    tmp = tmp_path_factory.mktemp("parallel")
    ctx = mp.get_context("spawn")
    procs, paths = [], {}
    for layout, spec in LAYOUTS.items():
        port = _free_port()
        paths[layout] = [str(tmp / f"{layout}.{r}.pt") for r in range(spec["world"])]
        procs += [ctx.Process(target=_worker, args=(layout, r, port, ckpt, paths[layout][r]))
                  for r in range(spec["world"])]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
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


def _need(runs, layout: str, *keys: str) -> list[dict]:
    """The ranks of `layout`, and of the 1-rank reference first, failing with the recorded
    error when a rank did not get as far as `keys`."""
    got = runs["ref"] + runs[layout]
    for name, r in zip(["ref"] + [f"{layout} rank {i}" for i in range(len(runs[layout]))], got):
        missing = [k for k in keys if k not in r]
        assert not missing, f"{name} has no {missing}: {r.get('error', 'stopped early')}"
    return got


TIGHT = dict(rtol=0.0, atol=1e-4)  # float32; the ranks only reorder sums


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_two_ranks_equal_one_rank_log_probs(runs, layout):
    ref, *ranks = _need(runs, layout, "layout", "lp")
    assert [r["layout"] for r in ranks] == [{"dp_rank": 0, "dp_size": 1, "is_output": True},
                                            {"dp_rank": 0, "dp_size": 1, "is_output": False}]
    for r in ranks:  # TP peers compute the same rows; CP peers gather them
        torch.testing.assert_close(r["lp"], ref["lp"], **TIGHT)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_two_ranks_equal_one_rank_ppo_update(runs, layout):
    ref, out, _ = _need(runs, layout, "train", "lp_after")
    for key, value in ref["train"].items():
        assert out["train"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    assert out["train"]["skipped_nonfinite"] == 0 and out["train"]["grad_norm"] > 0
    assert (out["lp_after"] - out["lp"]).abs().max() > 1e-3  # the update moved the policy
    # Adam divides by sqrt(v): near-zero gradients may move a weight by up to ~lr either way
    torch.testing.assert_close(out["lp_after"], ref["lp_after"], rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_two_ranks_equal_one_rank_critic(runs, layout):
    ref, *ranks = _need(runs, layout, "values", "critic_train", "values_after")
    for r in ranks:
        torch.testing.assert_close(r["values"], ref["values"], **TIGHT)
    out = ranks[0]
    for key, value in ref["critic_train"].items():
        assert out["critic_train"][key] == pytest.approx(value, rel=1e-3, abs=1e-5), key
    torch.testing.assert_close(out["values_after"], ref["values_after"], rtol=0.0, atol=2e-3)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_gathered_hf_weights_are_the_checkpoint_and_follow_the_update(runs, layout, ckpt):
    from roles.trainer.megatron.core import load_hf_state

    ref, out, peer = _need(runs, layout, "weights", "weights_after", "checksum", "save_hf")
    hf = load_hf_state(ckpt)
    assert set(out["weights"]) == set(hf)
    for name, tensor in hf.items():  # TP shards all-gathered back: bit-identical
        assert torch.equal(out["weights"][name], tensor.float()), name
    for name, tensor in ref["weights_after"].items():
        torch.testing.assert_close(out["weights_after"][name], tensor, rtol=0.0, atol=3e-4, msg=name)
    assert set(out["checksum"]) == set(hf)
    if layout == "tp2":  # the TP peer gathered the same full tensors
        assert peer["checksum"] == out["checksum"]
    saved = load_hf_state(out["save_hf"]["path"])
    assert set(saved) == set(hf) and all(torch.equal(saved[k], out["weights_after"][k]) for k in hf)
