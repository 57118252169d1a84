"""Trainer rank groups: token-balanced shards, order-preserving gathers, and data parallelism
over real rank processes (2 ranks on 2 fake GPUs, gloo) that matches one process."""

import os
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

from algorithms import AGG_MODES, aggregate
from roles.trainer import TrainerConfig, TrainerGroup, megatron_missing
from roles.trainer.batching import valid_mask
from roles.trainer.sharding import aggregation_counts, balance, plan_forward, plan_train, put_rows, take_rows
from roles.trainer.torch import ActorTrainer, CriticTrainer
from runtime import ActorDied, Supervisor

N = 8
PROMPT_LENS = torch.tensor([3, 5, 2, 4, 6, 3, 2, 5])
RESPONSE_LENS = torch.tensor([6, 2, 5, 3, 1, 4, 6, 2])
R = int(RESPONSE_LENS.max())


def make_batch(seed=0, packed=False):
    g = torch.Generator().manual_seed(seed)
    total = PROMPT_LENS + RESPONSE_LENS
    input_ids = torch.zeros(N, int(total.max()), dtype=torch.long)
    for i, t in enumerate(total.tolist()):
        input_ids[i, :t] = torch.randint(4, 40, (t,), generator=g)
    loss_mask = (torch.rand(N, R, generator=g) > 0.2).float()
    loss_mask[3] = 0  # an empty row: the seq-mean modes must not count it
    batch = {"input_ids": input_ids, "prompt_lens": PROMPT_LENS.clone(), "response_lens": RESPONSE_LENS.clone(),
             "loss_mask": loss_mask, "advantages": torch.randn(N, R, generator=g)}
    if packed:
        batch["input_ids"] = torch.cat([input_ids[i, :t] for i, t in enumerate(total.tolist())])
    return batch


# ---- sharding (no processes) ----------------------------------------------------------------

def test_balance_splits_by_tokens_keeps_rows_whole_and_gives_every_shard_a_row():
    costs = [100, 1, 1, 1, 1, 1, 1, 1, 50, 50]
    groups = balance(costs, 3)
    assert sorted(i for g in groups for i in g) == list(range(10))  # every row once
    assert all(g == sorted(g) for g in groups) and all(groups)
    loads = sorted(sum(costs[i] for i in g) for g in groups)
    assert loads == [53, 54, 100]  # the long row alone; the rest split evenly by tokens, not by count
    assert balance([5, 5], 4) == [[0], [1], [], []]


def test_forward_shards_gather_back_in_batch_order():
    batch = make_batch()
    rows = plan_forward(batch, 3)
    # each "rank" answers with its rows' ids (a [n, R'] float of its input row indices)
    parts = []
    for r in rows:
        share = take_rows(batch, r)
        assert share["input_ids"].shape[1] == int((share["prompt_lens"] + share["response_lens"]).max())
        assert share["loss_mask"].shape[1] == int(share["response_lens"].max())
        assert torch.equal(share["prompt_lens"], batch["prompt_lens"][r])
        out = torch.tensor(r, dtype=torch.float32).unsqueeze(1).expand(-1, share["loss_mask"].shape[1])
        parts.append((r, {"log_probs": out * (torch.arange(out.shape[1]) < share["response_lens"].unsqueeze(1))}))
    full = put_rows(parts, N)["log_probs"]
    assert full.shape == (N, R)
    for i in range(N):
        assert torch.all(full[i, : RESPONSE_LENS[i]] == i) and torch.all(full[i, RESPONSE_LENS[i]:] == 0)


def test_packed_input_ids_are_cut_per_sample():
    padded, packed = make_batch(), make_batch(packed=True)
    rows = [6, 1, 4]
    a, b = take_rows(padded, rows), take_rows(packed, rows)
    total = (a["prompt_lens"] + a["response_lens"]).tolist()
    assert torch.equal(b["input_ids"], torch.cat([a["input_ids"][j, :t] for j, t in enumerate(total)]))


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dp", [1, 2, 3])
def test_loss_aggregation_is_unchanged_by_the_data_parallel_split(mode, dp):
    batch = make_batch()
    loss = torch.randn(N, R, generator=torch.Generator().manual_seed(3))
    rows, minis = plan_train(batch, dp, global_batch_size=4, loss_agg_mode=mode)
    for step, mini in enumerate([list(range(0, 4)), list(range(4, 8))]):
        idx = torch.tensor(mini)
        valid = valid_mask(batch["loss_mask"][idx], batch["response_lens"][idx])
        whole = aggregate(loss[idx], valid, mode)
        parts = 0.0
        for rank in range(dp):
            start = sum(m["num_samples"] for m in minis[rank][:step])
            mine = rows[rank][start:start + minis[rank][step]["num_samples"]]
            assert set(mine) <= set(mini)  # a rank's share of mini-batch k comes from mini-batch k
            counts = {k: minis[rank][step][k] for k in ("global_batch_size", "global_token_count")}
            assert counts == aggregation_counts(valid, mode)  # the whole mini-batch's counts
            j = torch.tensor(mine)
            parts = parts + aggregate(loss[j], valid_mask(batch["loss_mask"][j], batch["response_lens"][j]), mode,
                                      **counts)
        torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-7)


# ---- rank processes ---------------------------------------------------------------------------

def trainer_config(ckpt, **overrides):
    base = dict(hf_checkpoint=ckpt, dtype="float32", seed=7, lr=1e-3, min_lr=0.0, lr_decay_style="constant",
                lr_warmup_iters=0, weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4,
                micro_batch_size=1, eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean",
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0,
                keep_ref=False)
    return TrainerConfig(**{**base, **overrides})


@pytest.fixture
def fake_sup(tmp_path):
    s = Supervisor(tmp_path / "run", fake_gpus=2, fake_gpu_bytes=8 << 30,
                   shutdown_grace_s=2.0)
    try:
        yield s
    finally:
        s.shutdown()


def spawn(sup, name, cls, config, gpus=(0, 1)) -> TrainerGroup:
    group = TrainerGroup.spawn(sup, name, cls, config, gpus=list(gpus), env={"OMP_NUM_THREADS": "1"})
    sup.leases.acquire_all(list(gpus), name)  # the lease of each GPU goes to the role, not a rank
    group.onload(["params", "optimizer"])
    return group


@pytest.mark.timeout(240)
def test_two_ranks_train_exactly_as_one_process_on_the_same_global_batch(ckpt, tmp_path, fake_sup):
    torch.set_num_threads(1)
    config = trainer_config(ckpt)
    group = spawn(fake_sup, "actor", ActorTrainer, config)
    assert group.layouts() == [{"dp_rank": 0, "dp_size": 2, "is_output": True},
                               {"dp_rank": 1, "dp_size": 2, "is_output": True}]
    single = ActorTrainer(config)
    single.onload(["params", "optimizer"])

    batch = make_batch()
    forward = {k: batch[k] for k in ("input_ids", "prompt_lens", "response_lens", "loss_mask")}
    old = group.compute_log_probs(forward)["log_probs"]  # gathered back in batch order
    torch.testing.assert_close(old, single.compute_log_probs(forward)["log_probs"], rtol=0, atol=1e-5)
    batch["old_log_probs"] = old

    metrics = group.train(batch)  # two optimizer steps (global_batch_size 4 of 8), each rank half of each
    expected = single.train(batch)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "lr", "skipped_nonfinite"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key

    def assert_same_weights(folder):
        group.save(str(tmp_path / folder))  # rank 0 writes
        trained = load_file(str(tmp_path / folder / "model.safetensors"))
        ours = dict(single.model.named_parameters())
        assert set(trained) == set(ours)
        for name, p in ours.items():
            torch.testing.assert_close(trained[name], p.detach(), rtol=0, atol=2e-6, msg=name)
        # the replicas stayed equal: the merged checksum sees no disagreement between the ranks
        assert group.weights_checksum()

    assert_same_weights("saved")

    # A NaN in one row reaches one rank only; both must skip that mini-batch's step, and only it.
    batch["advantages"][1, 0] = float("nan")
    metrics, expected = group.train(batch), single.train(batch)
    assert metrics["skipped_nonfinite"] == expected["skipped_nonfinite"] == 1
    assert_same_weights("saved-after-skip")

    report = group.offload(["params", "optimizer"])
    assert set(report["by_gpu"]) == {0, 1} and all(r["bytes_in_use"] == 0 for r in report["by_gpu"].values())


@pytest.mark.timeout(240)
def test_critic_group_values_match_one_process(ckpt, fake_sup):
    torch.set_num_threads(1)
    config = trainer_config(ckpt)
    group = spawn(fake_sup, "critic", CriticTrainer, config)
    single = CriticTrainer(config)
    single.onload(["params", "optimizer"])
    batch = make_batch()
    forward = {k: batch[k] for k in ("input_ids", "prompt_lens", "response_lens", "loss_mask")}
    values = group.compute_values(forward)["values"]
    torch.testing.assert_close(values, single.compute_values(forward)["values"], rtol=0, atol=1e-5)
    train = dict(forward, old_values=values, returns=torch.randn(N, R, generator=torch.Generator().manual_seed(1)))
    got, want = group.train(train), single.train(train)
    assert got["value_loss"] == pytest.approx(want["value_loss"], rel=1e-5)


@pytest.mark.timeout(120)
def test_a_dead_rank_stops_its_group_and_every_call_names_it(ckpt, fake_sup):
    group = TrainerGroup.spawn(fake_sup, "actor", ActorTrainer, trainer_config(ckpt), gpus=[0, 1],
                               env={"OMP_NUM_THREADS": "1"})
    assert len(group.layouts()) == 2
    pid0 = fake_sup.pid("actor.0")
    group.ranks[1].kill()
    with pytest.raises(ActorDied) as info:
        group.onload.call(["params"]).result(timeout=30)
    assert info.value.role == "actor.1" and "SIGKILL" in info.value.reason
    assert group.rank_of(info.value.role) == 1
    # the group stops its peers (asynchronously: rank 0 may still answer until it is stopped)
    deadline = time.monotonic() + 20
    while fake_sup._children["actor.0"].process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fake_sup._children["actor.0"].process.is_alive()
    with pytest.raises(ActorDied, match="actor.1"):  # the stopped peer's calls name the dead rank too
        group.ranks[0].rank_layout()
    with pytest.raises(ProcessLookupError):
        os.kill(pid0, 0)


@pytest.mark.timeout(60)
def test_spawn_group_gives_each_rank_the_distributed_env_and_one_gpu(sup):
    from tests.actors import Echo

    ranks = sup.spawn_group("grp", Echo, gpus=[3, 5])
    assert [r.name for r in ranks] == ["grp.0", "grp.1"]
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    envs = [r.env(*keys) for r in ranks]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"] and int(envs[0]["MASTER_PORT"]) > 0
    for rank, (env, gpu) in enumerate(zip(envs, ("3", "5"))):
        assert env == dict(env, MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                           CUDA_VISIBLE_DEVICES=gpu)
    other = sup.spawn_group("other", Echo, gpus=[0])
    assert other[0].env("MASTER_PORT")["MASTER_PORT"] != envs[0]["MASTER_PORT"]  # one port per group


@pytest.mark.timeout(60)
def test_the_supervisor_holds_a_groups_rendezvous_port_until_the_group_dies(sup):
    """The port is the supervisor's store from before the ranks start (no window in which
    another process can take it, as a probed-and-closed free port had: EADDRINUSE in CI)."""
    from tests.actors import Echo

    ranks = sup.spawn_group("grp", Echo, gpus=[0, 1])
    port = int(ranks[0].env("MASTER_PORT")["MASTER_PORT"])
    with pytest.raises(OSError, match="in use"), socket.socket() as s:
        s.bind(("127.0.0.1", port))
    sup.kill("grp.1")
    deadline = time.monotonic() + 20
    while True:  # the group dies as one, and its store goes with it
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                break
            except OSError:
                assert time.monotonic() < deadline, f"port {port} still held after the group died"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_rank_that_fails_to_start_fails_wait_ready_at_once_with_its_traceback(sup):
    from tests.actors import FailsInInit

    sup.spawn_group("grp", FailsInInit, gpus=[0, 1])
    with pytest.raises(ActorDied, match=r"(?s)grp\.[01].*bad checkpoint path") as info:
        sup.wait_ready(timeout=50)
    assert info.value.error_file and info.value.error_file.endswith(".0.txt")


def test_replicas_that_diverged_are_an_error_in_the_merged_checksum():
    from roles.trainer.group import _merge_checksums

    assert _merge_checksums([{"a": "1", "b": "2"}, {"a": "1", "b": "2"}, {}]) == {"a": "1", "b": "2"}
    with pytest.raises(RuntimeError, match="rank 1 holds a different 'b'.*diverged"):
        _merge_checksums([{"a": "1", "b": "2"}, {"a": "1", "b": "3"}])


def test_rank_groups_need_gpus_and_unique_names(fake_sup):
    with pytest.raises(ValueError, match="needs gpus"):
        fake_sup.spawn_group("actor", ActorTrainer, {}, gpus=[])
    with pytest.raises(ValueError, match="must not contain '.'"):
        fake_sup.spawn_group("a.b", ActorTrainer, {}, gpus=[0])


@pytest.mark.skipif(megatron_missing() is None, reason="megatron-core and CUDA are here: nothing to refuse")
def test_megatron_backend_is_refused_before_anything_starts_where_it_cannot_run(tmp_path):
    from ppo.config.serialize import override
    from ppo.setup.job import JobSetupError, start_job
    from ppo.config.recipes import tiny_ppo

    cfg = override(tiny_ppo(), run_dir=str(tmp_path / "run"), train_backend="megatron")
    with pytest.raises(JobSetupError, match=r"--train-backend megatron cannot run here: .*--train-backend torch"):
        start_job(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


@pytest.mark.timeout(60)
def test_the_death_of_a_respawned_ranks_old_incarnation_is_not_taken_for_the_new_ones(sup):
    """respawn_group stops a live rank and starts it again; the watch thread may hold the old
    process's sentinel from before and see it fire after the restart. Found on the H200: a
    megatron recovery failed with "critic.0 (incarnation 1) died: exited with code 0", the
    exit of incarnation 0 that respawn_group had stopped."""
    from tests.actors import Echo

    sup.spawn_group("grp", Echo, gpus=[0])
    sup.wait_ready(timeout=30)
    child = sup._children["grp.0"]
    old, old_process = child.incarnation, child.process
    sup.respawn_group("grp", "a test")
    sup.wait_ready(timeout=30)
    assert child.incarnation == old + 1 and not old_process.is_alive()
    sup._on_death(child, old, reason="exited with code 0")  # what the watch thread did with the stale sentinel
    rank = sup.handle("grp.0")
    assert rank.env("RANK") == {"RANK": "0"}  # the new incarnation still serves
    assert child.state != "dead"
