"""--train-async's rollout source (ppo.generate.rollout_ahead) without processes: the next rollout
generates while the step trains, nothing older than the staleness bound comes out, a
checkpoint records the data position before the rollout ahead; and its config rules."""

import threading
import time

import pytest

from ppo.config import override, use_tis, validate
from ppo.config.recipes import tiny_ppo
from ppo.generate.rollout_ahead import STALE_RETRY_ROUND, Rollouts

pytestmark = pytest.mark.timeout(60)

N = 2  # samples per prompt


def samples_of(step: int, num_groups: int, version: int) -> list[dict]:
    """What ppo.generate.dynamic_sampling.sample_batch returns: groups in batch order, each sample stamped
    with the weight version of the engine that generated it."""
    return [{"index": g * N + k, "group_index": g, "prompt": f"p{step}.{g}", "prompt_ids": [step, g],
             "label": str(g), "metadata": {}, "weight_version": version, "reward": 0.0}
            for g in range(num_groups) for k in range(N)]


class Engines:
    """The engines' side: the version they hold, the prompts drawn, and each call made."""

    def __init__(self):
        self.version, self.position = 0, 0
        self.started: list[int] = []
        self.gates: dict[int, threading.Event] = {}  # step -> what its generation waits for
        self.regenerated: list[tuple[list[dict], int, int]] = []

    def rollout(self, step: int):
        self.started.append(step)
        self.position += 3  # prompts drawn
        version = self.version
        if step in self.gates:
            assert self.gates[step].wait(10), f"rollout {step} was never let through"
        return samples_of(step, 3, version), {"rollout/x": float(step)}

    def regenerate(self, prompts: list[dict], step: int, sampling_round: int) -> list[dict]:
        self.regenerated.append((prompts, step, sampling_round))
        return [{"index": j * N + k, "group_index": j, "prompt": p["prompt"], "prompt_ids": p["prompt_ids"],
                 "label": p["label"], "metadata": p["metadata"], "weight_version": self.version, "reward": 1.0}
                for j, p in enumerate(prompts) for k in range(N)]

    def state_dict(self) -> dict:
        return {"position": self.position}


def rollouts(engines: Engines, *, ahead: bool, num_rollout: int = 5, max_staleness: int = 1) -> Rollouts:
    return Rollouts(engines.rollout, engines.regenerate, data=engines, ahead=ahead, num_rollout=num_rollout,
                    max_staleness=max_staleness)


def test_ahead_the_next_rollout_generates_while_the_step_trains_on_the_old_weights():
    e = Engines()
    e.gates[1] = threading.Event()
    with rollouts(e, ahead=True) as r:
        samples, metrics = r.take(0, 0)
        assert e.started == [0, 1]  # rollout 1 started before step 0 trained
        assert metrics["rollout/staleness"] == 0
        e.version = 1  # the actor trained; its weights are not on the engines yet
        e.gates[1].set()
        r.wait_generated(1)
        samples, metrics = r.take(1, 1)
    assert {s["weight_version"] for s in samples} == {0}  # generated during step 0, on version 0
    assert metrics["rollout/staleness"] == 1 and metrics["rollout/stale_groups"] == 0
    assert metrics["rollout/x"] == 1.0 and metrics["perf/rollout_ahead_time"] >= 0
    assert e.started == [0, 1, 2]


def test_synchronous_rollouts_generate_when_the_step_asks_and_none_ahead():
    e = Engines()
    with rollouts(e, ahead=False) as r:
        r.take(0, 0)
        assert e.started == [0]
        r.take(1, 0)
    assert e.started == [0, 1]


def test_no_rollout_is_started_past_the_last_step():
    e = Engines()
    with rollouts(e, ahead=True, num_rollout=2) as r:
        r.take(0, 0)
        r.wait_generated(0)
        r.take(1, 0)
        r.wait_generated(0)
    assert e.started == [0, 1]


@pytest.mark.parametrize("bound", [1, 2])
def test_a_group_older_than_the_bound_is_generated_again_and_none_is_trained_on(bound):
    e = Engines()

    def rollout(step):
        samples, metrics = Engines.rollout(e, step)
        for s in samples[2:4]:  # group 1: made by an engine bound + 1 versions behind
            s["weight_version"] = 5 - bound - 1
        for s in samples[4:6]:  # group 2: exactly at the bound
            s["weight_version"] = 5 - bound
        return samples, metrics

    e.rollout, e.version = rollout, 5
    with Rollouts(e.rollout, e.regenerate, data=e, ahead=False, num_rollout=1, max_staleness=bound) as r:
        samples, metrics = r.take(0, 5)
    [(prompts, step, rnd)] = e.regenerated
    assert [p["prompt"] for p in prompts] == ["p0.1"] and step == 0 and rnd == STALE_RETRY_ROUND
    assert [s["weight_version"] for s in samples] == [5, 5, 5, 5, 5 - bound, 5 - bound]
    assert [(s["index"], s["group_index"], s["prompt"]) for s in samples[2:4]] == [(2, 1, "p0.1"), (3, 1, "p0.1")]
    assert metrics["rollout/stale_groups"] == 1 and metrics["rollout/staleness"] == bound


def test_a_checkpoint_records_the_data_position_before_the_rollout_ahead():
    e = Engines()
    with rollouts(e, ahead=True, num_rollout=3) as r:
        r.take(0, 0)
        r.wait_generated(0)
        assert e.position == 6 and r.data_position().state_dict() == {"position": 3}
        r.take(1, 0)
        r.take(2, 0)  # the last: nothing ahead
        assert r.data_position() is e


def test_the_rollout_aheads_error_is_raised_in_the_step_that_takes_it():
    e = Engines()

    def rollout(step):
        if step == 1:
            raise RuntimeError("engine exploded")
        return Engines.rollout(e, step)

    with Rollouts(rollout, e.regenerate, data=e, ahead=True, num_rollout=3, max_staleness=1) as r:
        r.take(0, 0)
        with pytest.raises(RuntimeError, match="engine exploded"):
            r.take(1, 0)


def acquirable(lock) -> bool:
    """Whether another thread can take `lock` (then it lets it go again)."""
    got = []

    def take():
        got.append(lock.acquire(timeout=2))
        if got[0]:
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return got[0]


def test_an_error_waits_for_the_rollout_ahead_and_a_signals_stop_does_not():
    class Stopped(BaseException):  # as ppo.state.signals.RunStopped
        pass

    for error, waits in ((RuntimeError("a trainer died"), True), (Stopped(), False)):
        e = Engines()
        e.gates[1] = threading.Event()
        t0 = time.monotonic()  # before the timer starts: a wait is then at least its 1 s
        threading.Timer(1.0, e.gates[1].set).start()
        with pytest.raises(type(error)):
            with rollouts(e, ahead=True) as r:
                r.take(0, 0)
                raise error
        assert (time.monotonic() - t0 >= 1.0) == waits, error
        assert acquirable(r.lock)  # let go either way
        e.gates[1].wait(5)


def test_an_engine_recovery_ahead_waits_until_the_driver_stops_training():
    """The recovery uses the actor and the lease table: only while the driver waits."""
    e = Engines()
    entered = threading.Event()
    r = rollouts(e, ahead=True)

    def rollout(step):
        if step == 1:
            with r.lock:  # what ppo.loop's recover_engine does
                entered.set()
                assert r.version == 1  # the actor's version when the driver let go
        return Engines.rollout(e, step)

    r.rollout = rollout
    with r:
        r.take(0, 0)
        assert not entered.wait(0.3)  # the driver holds it: training
        r.wait_generated(1)
        assert entered.is_set()


def tiny(**values):
    return override(tiny_ppo(), **values)


ASYNC = dict(train_async=True, colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1)


def test_async_config_rules_name_the_flag_and_the_fix():
    assert validate(tiny(**ASYNC)) == []
    # colocated, side by side: the engine's memory budget and the trainers' resident weights
    # (tests/test_side_by_side.py)
    budget, level = validate(tiny(train_async=True))
    assert "Please add --sglang-mem-fraction-static F" in budget and "Please add --offload-train-level optimizer" in level
    [offloading] = validate(tiny(**ASYNC, offload_rollout=True))
    assert "--offload-rollout (placement.offload_rollout)" in offloading and "Please remove --offload-rollout" in offloading
    assert any("--max-weight-staleness 0" in p for p in validate(tiny(**ASYNC, max_weight_staleness=0)))
    # a reward model on the engines' GPUs would wait for engines that generate ahead
    [shared_rm] = validate(tiny(**ASYNC, reward_model_path="/rm"))
    assert "--train-async" in shared_rm and "Please add --reward-model-num-gpus N" in shared_rm
    assert validate(tiny(**ASYNC, reward_model_path="/rm", reward_model_num_gpus=1,
                         num_gpus_per_node=3)) == []


def test_async_weights_the_loss_by_tis_unless_the_ratio_takes_the_engines_log_probs():
    assert use_tis(tiny(**ASYNC)) and not use_tis(tiny())
    assert not use_tis(tiny(**ASYNC, use_rollout_logprobs=True))
    # a custom weighting needs TIS on: --train-async turns it on
    path = "algorithms.mismatch:masked_is"
    assert validate(tiny(**ASYNC, custom_tis_function_path=path)) == []
    assert validate(tiny(custom_tis_function_path=path)) != []
