"""Placement modes end to end on fake GPUs: each learns, and the lease ledger checks it.

colocated (tests/test_e2e_ppo.py runs it at length), disaggregated with miles' defaults
(`--no-colocate`: trainers offload, since actor and critic share their GPUs; engines stay
resident), and disaggregated with the two offload switches flipped (`--no-offload-train`:
actor and critic resident side by side; `--offload-rollout`: engines release after each
rollout), and disaggregated GRPO (no critic: the actor stays resident by default). Every
mode must learn the generated sums a little within a short run.
"""

import pytest

from ppo.config import num_critic_only_steps
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.gpu.plan_check import plan_mismatches
from ppo.loop import train
from ppo.config.recipes import tiny_ppo
from runtime.fakegpu import FakeDevice, check_no_overlap
from runtime.events import read_events

NUM_ROLLOUT = 30

DISAGGREGATED = dict(colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1)
MODES = {
    "disaggregated": DISAGGREGATED,
    "disaggregated-resident-trainers-offloading-engines": dict(
        DISAGGREGATED, offload_train=False, offload_rollout=True),
    # no critic: the actor alone on its GPU stays resident by default (miles' disaggregated GRPO)
    "disaggregated-grpo": dict(DISAGGREGATED, advantage_estimator="grpo", num_critic_only_steps=0),
    # the one-GPU plans of qwen3_4b_ppo (docs/journal/, "The memory plan"): trainers keep weights and
    # swap optimizers, the engine keeps its weights and KV cache; GRPO keeps everything
    "colocated-resident-weights": dict(offload_train_level="optimizer", offload_rollout=False),
    "colocated-kv-cache-only": dict(offload_train_level="optimizer", offload_rollout_level="kv_cache"),
    "colocated-grpo-resident": dict(advantage_estimator="grpo", num_critic_only_steps=0,
                                    offload_train=False, offload_rollout=False),
}


def run_mode(tmp_path, mode: str) -> tuple[list[dict], dict[int, list[dict]], int]:
    """(metrics, each fake GPU's ledger history, critic-only warm-up steps) of a run in `mode`."""
    # no evaluation: what a mode changes is where the roles live, not what an eval sees
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=NUM_ROLLOUT,
                                check_weight_update_equal=True, eval_prompt_data=None,
                                eval_interval=None, **MODES[mode]))
    history = train(cfg)
    # the run's ledgers until its last step was logged: then the job shuts down, and each role's
    # memory is freed (an engine's on_stop, the supervisor dropping what a stopped role held)
    shutdown = max(e["ts"] for e in read_events(tmp_path / "run") if e["event"] == "metrics")
    devices = {g: [h for h in FakeDevice(tmp_path / "run" / "fakegpu", g).history() if h["ts"] < shutdown]
               for g in (0, 1)}
    return history, devices, num_critic_only_steps(cfg)


def usage_by_holder(history: list[dict]) -> list[dict[str, int]]:
    """Bytes per holder after each change of a device's history."""
    tags: dict[tuple[str, str], int] = {}
    out = []
    for entry in history:
        if entry["kind"] == "usage":
            tags[(entry["holder"], entry["tag"])] = entry["nbytes"]
        by_holder: dict[str, int] = {}
        for (holder, _), nbytes in tags.items():
            by_holder[holder] = by_holder.get(holder, 0) + nbytes
        out.append(by_holder)
    return out


def learned(history: list[dict]) -> tuple[float, float]:
    rewards = [h["rollout/raw_reward"] for h in history]
    return sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3


# One mode in `make test` (miles' disaggregated default; tests/test_e2e_ppo.py runs colocated), a
# 30-rollout run of 1-1.5 minutes on 2 cores; the rest in `make test-slow`.
FAST_MODES = ("disaggregated",)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", [m if m in FAST_MODES else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_placement_mode_learns_and_the_ledger_holds(tmp_path, mode):
    history, devices, warmup = run_mode(tmp_path, mode)
    # synced after every step past the warm-up
    assert [h["rollout/weight_version"] for h in history] == [max(0, s + 1 - warmup) for s in range(NUM_ROLLOUT)]
    first, last = learned(history)
    assert last - first >= 0.1, f"{mode}: reward did not rise: first 3 {first:.2f}, last 3 {last:.2f}"
    for gpu, hist in devices.items():
        assert check_no_overlap(hist) == [], f"{mode}: gpu {gpu}"
    # each phase's peak on each fake GPU is the memory plan's (ppo.gpu.plan_check), or below it by
    # what narrower micro-batches left out
    assert plan_mismatches(tmp_path / "run", NUM_ROLLOUT - 1, below=0.15) == [], mode
    growers = {g: {h["holder"] for h in hist if h["kind"] == "usage" and h["nbytes"]} for g, hist in devices.items()}
    if mode.startswith("colocated-"):
        assert_resident_tags(mode, devices[0])
        return
    # disaggregated: trainers on gpu 0, the engine on gpu 1, never shared
    trainer_names = {"actor"} if mode == "disaggregated-grpo" else {"actor", "critic"}
    assert growers[0] == trainer_names and growers[1] == {"rollout-0"}
    for gpu, names in ((0, ("actor", "critic")), (1, ("rollout-0",))):
        assert {h["holder"] for h in devices[gpu] if h["kind"] == "lease"} <= set(names) | {None}
    trainers = usage_by_holder(devices[0])
    engine = [u.get("rollout-0", 0) for u in usage_by_holder(devices[1])]
    both_resident = any(u.get("actor", 0) and u.get("critic", 0) for u in trainers)
    if mode in ("disaggregated", "disaggregated-grpo"):  # the engine never lets go
        assert min(engine[engine.index(max(engine)):]) == max(engine)
    if mode == "disaggregated":  # actor and critic take turns
        assert not both_resident
    if mode == "disaggregated-grpo":  # the actor, once onloaded, stays
        actor = [u.get("actor", 0) for u in trainers]
        assert min(actor[actor.index(max(actor)):]) > 0
    if mode == "disaggregated-resident-trainers-offloading-engines":
        # resident trainers side by side; the engine releases after every rollout
        assert both_resident
        assert engine.count(0) >= NUM_ROLLOUT


def assert_resident_tags(mode: str, history: list[dict]) -> None:
    """Each tag a plan keeps is never freed once it is first on the device; each tag it
    offloads is (the optimizers take turns)."""
    kept = {("actor", "params"), ("rollout-0", "weights")}
    swapped = {("actor", "optimizer")}
    if mode != "colocated-grpo-resident":
        kept.add(("critic", "params"))
        swapped.add(("critic", "optimizer"))
    if mode == "colocated-kv-cache-only":
        swapped.add(("rollout-0", "kv_cache"))
    else:
        kept.add(("rollout-0", "kv_cache"))
    if mode == "colocated-grpo-resident":
        kept |= swapped
        swapped = set()
    series: dict[tuple[str, str], list[int]] = {}
    for h in history:
        if h["kind"] == "usage":
            series.setdefault((h["holder"], h["tag"]), []).append(h["nbytes"])
    for key in kept:
        values = series[key]
        first = next(i for i, v in enumerate(values) if v)
        assert all(values[first:]), f"{mode}: {key} was freed after it was first resident"
    for key in swapped:
        values = series[key]
        assert max(values) and values.count(0) >= NUM_ROLLOUT // 2, f"{mode}: {key} stayed resident"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offload_train", [True, False])
def test_disaggregated_engine_killed_mid_generation_is_resynced_from_the_actors_gpus(tmp_path, offload_train):
    """The restarted engine gets the current policy from the actor, which takes its own (idle)
    GPUs to send: resident, its bucket buffers are charged there, under its lease."""
    from bench.faults import after_first_rollout
    from tests.test_faults_ppo import assert_full_batches, run_with_fault

    values = dict(DISAGGREGATED, offload_train=offload_train, num_rollout=3, rollout_batch_size=16,
                  check_weight_update_equal=True)
    history, _ = run_with_fault(tmp_path, "rollout-0", after_first_rollout("rollout-0", "generating"), **values)
    assert sum(h["rollout/engine_restarts"] for h in history) == 1
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)  # the restarted engine runs the policy
    assert_full_batches(tmp_path, values, 3)
    hist = FakeDevice(tmp_path / "run" / "fakegpu", 0).history()
    assert check_no_overlap(hist) == []
    # the sync buffers grew on the actor's GPU under its lease (a resident actor re-syncing the
    # engine without the lease would have died of a LeaseViolation)
    buffers = [h for h in hist if h["kind"] == "usage" and h["tag"] == "weight_sync_buffer" and h["nbytes"]]
    assert buffers and all(h["lease_holder"] == "actor" for h in buffers)


@pytest.mark.timeout(300)
def test_tied_embeddings_pass_the_weight_check_after_every_sync(tmp_path):
    """Qwen3-4B ties its embeddings; a tied model's run checks engine weights after each sync."""
    from ppo.tiny_model import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "tied"), tie_word_embeddings=True)
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), hf_checkpoint=ckpt, num_rollout=2,
                                num_critic_only_steps=0, rollout_batch_size=16, check_weight_update_equal=True))
    history = train(cfg)  # raises if an engine's weights differ from the actor's after a sync
    assert [h["rollout/weight_version"] for h in history] == [1, 2]
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)
