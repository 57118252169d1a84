"""Faults during PPO, injected into real role processes: nothing is lost, or the run stops
with a message that says what happened and how to resume."""

import json
import time

import pytest

from bench.faults import Injector, after_first_rollout
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.setup.job import start_job
from ppo.loop import TrainerDied, run, train
from ppo.config.recipes import tiny_ppo
from runtime.events import read_events

pytestmark = pytest.mark.timeout(300)


def tiny(tmp_path, **values):
    return ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), **values))


def run_with_fault(tmp_path, victim, trigger, **values):
    job = start_job(tiny(tmp_path, **values))
    inj = Injector(job, victim, trigger)
    inj.start()
    try:
        history = run(job)
    finally:
        inj.stop = True
        job.close()
    assert inj.fired_at, "the fault was never injected"
    return history, inj


def assert_full_batches(tmp_path, cfg_values, num_rollout):
    n = cfg_values["rollout_batch_size"] * tiny_ppo().rollout.n_samples_per_prompt
    for step in range(num_rollout):
        rows = [json.loads(x) for x in (tmp_path / "run" / "samples" / f"rollout_{step:05d}.jsonl")
                .read_text().splitlines()]
        assert sorted(r["index"] for r in rows) == list(range(n))  # every sample, none twice
        assert all(r["reward_status"] == "ok" for r in rows)


def test_engine_killed_mid_generation_is_replaced_resynced_and_its_prompts_reissued(tmp_path):
    values = dict(num_rollout=4, rollout_batch_size=32, check_weight_update_equal=True)
    history, inj = run_with_fault(tmp_path, "rollout-0", after_first_rollout("rollout-0", "generating"), **values)
    assert sum(h["rollout/engine_restarts"] for h in history) == 1
    events = read_events(tmp_path / "run")
    died = next(e for e in events if e["event"] == "died" and e["role"] == "rollout-0")
    assert died["ts"] - inj.fired_at[0] < 1.0  # detected within a second
    assert any(e["event"] == "restarted" and e["role"] == "rollout-0" for e in events)
    assert_full_batches(tmp_path, values, 4)
    # the replacement generated with the current policy: engine and trainer log-probs agree
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)


@pytest.mark.slow  # 33 s; the chaos row in make test kills scorers too
def test_reward_scorer_killed_is_replaced_and_its_samples_rescored_once(tmp_path):
    values = dict(num_rollout=3, rollout_batch_size=64)
    history, _ = run_with_fault(tmp_path, "reward-0", after_first_rollout("reward-0", "scoring"), **values)
    # one kill, one restart: counted once even when the kill lands after its last call of
    # the step (no caller sees the death) or fails two calls in flight
    assert sum(h["rollout/scorer_restarts"] for h in history) == 1
    assert history[-1]["rollout/scorer_restarts_total"] == 1
    assert_full_batches(tmp_path, values, 3)


def test_trainer_killed_stops_the_run_naming_the_role_and_how_to_resume(tmp_path):
    # GRPO: no critic ranks to start, and the actor trains (and dies) from rollout 0
    cfg = tiny(tmp_path, num_rollout=5, rollout_batch_size=16, save=str(tmp_path / "ckpt"), save_interval=1,
               advantage_estimator="grpo")
    job_holder = {}

    import ppo.loop as loop
    real_start = loop.start_job

    def start_and_arm(c, *args, **kwargs):
        job = job_holder["job"] = real_start(c, *args, **kwargs)
        # one rank of the actor's group (2 ranks on the 2 fake GPUs) dies mid-update
        Injector(job, "actor.1", after_first_rollout("actor.1", "training")).start()
        return job

    loop.start_job = start_and_arm
    try:
        t0 = time.monotonic()
        with pytest.raises(TrainerDied) as info:
            train(cfg)
    finally:
        loop.start_job = real_start
    msg = str(info.value)
    assert "the actor trainer died: its rank 1 (actor.1) died (killed by SIGKILL)" in msg
    assert f"--load {tmp_path / 'ckpt'}" in msg
    assert time.monotonic() - t0 < 120
    assert job_holder["job"].sup._closed  # everything was shut down


def test_skipped_updates_past_the_limit_stop_the_run_with_a_hint():
    from ppo.loop import check_skipped
    cfg = override(tiny_ppo(), max_skipped_updates=2)
    assert check_skipped(cfg, 2) == 2
    with pytest.raises(RuntimeError, match=r"3 optimizer steps were skipped .*--max-skipped-updates 2"):
        check_skipped(cfg, 3)


def when_the_actor_takes_gpu0():
    """A trigger: the actor takes GPU 0's lease from the engines, once rollout 0 is logged."""
    logged = []

    def trigger(e: dict) -> bool:
        if e["event"] == "metrics":
            logged.append(e)
        return (bool(logged) and e["event"] == "lease" and e["action"] == "acquire" and e["gpu"] == 0
                and e["holder"] == "actor")
    return trigger


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
def test_engine_killed_while_the_actor_holds_its_gpu_restarts_when_the_lease_comes_back(tmp_path):
    """The dead engine cannot load its weights while the actor holds the GPU's lease: the
    supervisor defers its restart (not counted toward the restart intensity) until the loop
    hands the lease back to the engines, and the run completes."""
    values = dict(num_rollout=3, rollout_batch_size=16, check_weight_update_equal=True)
    history, inj = run_with_fault(tmp_path, "rollout-0", when_the_actor_takes_gpu0(), **values)
    events = read_events(tmp_path / "run")
    died = next(e for e in events if e["event"] == "died" and e["role"] == "rollout-0")
    deferred = next(e for e in events if e["event"] == "restart_deferred" and e["role"] == "rollout-0")
    # the holder it waits for is a trainer, or nobody between two handoffs (the kill lands
    # asynchronously after the trigger); never the engine itself
    assert deferred["ts"] >= died["ts"] and deferred["waiting_for"]["0"] in ("actor", "critic", None)
    taken = next(e for e in events if e["event"] == "lease" and e["action"] == "acquire"
                 and e["holder"] == "rollout-0" and e["ts"] > died["ts"])
    restarted = next(e for e in events if e["event"] == "restarted" and e["role"] == "rollout-0")
    assert restarted["ts"] >= taken["ts"]  # not before the engine holds its GPU again
    assert not any(e["event"] == "failed" for e in events)
    assert sum(1 for e in events if e["event"] == "died" and e["role"] == "rollout-0") == 1  # no failed restarts
    assert [h["step"] for h in history] == [0, 1, 2]
    assert_full_batches(tmp_path, values, 3)
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)  # it runs the current policy


# chaos in `make test`; its async and side-by-side rows in `make test-slow` (the suite's 20 minutes)
@pytest.mark.parametrize("row_name", ["chaos", pytest.param("chaos-async", marks=pytest.mark.slow),
                                      pytest.param("chaos-side", marks=pytest.mark.slow)])
def test_chaos_kills_engines_and_scorers_at_random_and_the_run_loses_nothing(tmp_path, row_name):
    """The machinery of bench.faults' chaos rows, on a short run: one kill of each victim."""
    from bench.faults import CHAOS_ROWS, run_chaos

    row = run_chaos(tmp_path, num_rollout=5, batch=16, kills_each=1, seed=1, gap_s=(0.2, 0.5),
                    values=CHAOS_ROWS[row_name])
    assert row["outcome"] == "completed" and row["rollouts"] == 5
    assert row["samples_lost"] == 0
    assert row["kills"] >= 2 and row["recovered"] == row["kills"]
    assert set(row["kills_by_role"]) <= {"rollout-0", "rollout-1", "reward-0", "reward-1"}
    assert sum(row["kills_by_moment"].values()) == row["kills"]
    assert 0 <= row["detect_s"] < 1.0 and row["recover_s"] > row["detect_s"]


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
def test_engine_killed_as_its_generation_ends_is_recovered_at_the_handoff(tmp_path):
    """Killed once it has generated (it holds its GPU, the scorers still work): the loop's
    next call to it is the release of its memory, which finds it dead or restarting; the
    handoff waits for the new incarnation, syncs it, and runs again."""
    values = dict(num_rollout=3, rollout_batch_size=16, check_weight_update_equal=True)
    done_generating = after_first_rollout("rollout-0", "ready")
    history, inj = run_with_fault(tmp_path, "rollout-0", done_generating, **values)
    events = read_events(tmp_path / "run")
    assert any(e["event"] == "restarted" and e["role"] == "rollout-0" for e in events)
    assert not any(e["event"] == "failed" for e in events)
    assert [h["step"] for h in history] == [0, 1, 2]
    assert_full_batches(tmp_path, values, 3)
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)


def test_an_engine_found_dead_at_a_handoff_is_recovered_and_the_handoff_rerun(monkeypatch):
    """A kill that lands after the generation ended is found at the next memory handoff: the
    engine is recovered there and the handoff runs again (the supervisor counts the restart)."""
    from types import SimpleNamespace

    import ppo.gpu.handoffs
    from runtime import ActorDied

    recovered, calls = [], []
    monkeypatch.setattr(ppo.gpu.handoffs, "recover", lambda job, role, dead, version: recovered.append((role.name, dead)))
    job = SimpleNamespace(engines=[SimpleNamespace(name="rollout-0")])

    def handoff():
        calls.append(1)
        if len(calls) == 1:
            raise ActorDied("rollout-0", 2, "killed")

    ppo.gpu.handoffs.engine_handoff(job, handoff, 5)
    assert (recovered, len(calls)) == ([("rollout-0", 2)], 2)

    def trainer_dies():
        raise ActorDied("actor.0", 1, "killed")

    with pytest.raises(ActorDied):  # not an engine: the handoff does not own it
        ppo.gpu.handoffs.engine_handoff(job, trainer_dies, 5)
    assert recovered == [("rollout-0", 2)]


def test_step_restarts_are_the_supervisors_counts_since_the_step_began():
    from types import SimpleNamespace

    from ppo.loop import restarts_since

    names = lambda *n: [SimpleNamespace(name=x) for x in n]  # noqa: E731
    sup = SimpleNamespace(restart_counts=lambda: {"rollout-0": 3, "rollout-1": 1, "reward-0": 2, "actor.0": 5,
                                                  "reward-model-1": 1})
    job = SimpleNamespace(sup=sup, engines=names("rollout-0", "rollout-1"), scorers=names("reward-0", "reward-1"),
                          reward_models=names("reward-model-0", "reward-model-1"))
    assert restarts_since(job, {"rollout-0": 2, "reward-0": 2}) == (2, 1)
