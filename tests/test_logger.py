"""ppo.observe.logger's outputs beside metrics.jsonl: wandb and tensorboard keep every rollout and eval,
in the order the loop logs them, through a trainer recovery's rewind and a --load resume."""

from __future__ import annotations

import io
import sys

import pytest

from ppo.observe.console import RunConsole
from ppo.observe.logger import EVAL_STEP, ROLLOUT_STEP, RunLogger
from ppo.observe.metrics_file import read_metrics, trim_metrics

REWARD, PASS = "rollout/raw_reward", "eval/heldout/pass@1"


class FakeWandb:
    """wandb's module as RunLogger uses it (init, define_metric, log, finish). Its step rule is
    wandb-core's (handler.go, handlePartialHistorySync): a record with a `step` lower than the
    run's current step is dropped with a warning, a higher one commits what is pending and
    moves the step there, and a record without `step` is committed at the current step, which
    then goes up by one. define_metric(name, step_metric=s) plots name against s's logged
    value. Where it differs: nothing leaves the process, records are committed at once, and
    `chart(name)` gives the (x, y) points a wandb chart of `name` would draw, in log order."""

    def __init__(self):
        self.step = 0
        self.records: list[tuple[int, dict]] = []
        self.dropped: list[int] = []
        self.axes: dict[str, str] = {}
        self.inits: list[dict] = []

    def init(self, id=None, resume=None, **kwargs):
        """A new run, or with `id` and resume="allow" that run's (its step goes on)."""
        self.inits.append(dict(id=id, resume=resume))
        self.id = id or f"run{len(self.inits)}"
        return self

    def define_metric(self, name, step_metric=None):
        self.axes[name] = step_metric

    def log(self, data, step=None):
        if step is not None and step < self.step:
            self.dropped.append(step)
            return
        self.step = self.step if step is None else step
        self.records.append((self.step, dict(data)))
        self.step += step is None

    def chart(self, name: str) -> list[tuple[float, float]]:
        axis = self.axes.get(name)
        return [(r[axis] if axis else s, r[name]) for s, r in self.records if name in r]

    def finish(self):
        pass


def logger(tmp_path, **kw) -> RunLogger:
    return RunLogger(tmp_path, num_rollout=8, publish=lambda e, **f: None, console=RunConsole("quiet", out=io.StringIO()),
                     dump_samples=False, **kw)


def run_steps(log: RunLogger, steps, reward, with_evals: bool = True) -> None:
    """Rollouts as the loop logs them: each step's eval (tagged step + 1) before its metrics."""
    for step in steps:
        log.step_phases(step)
        if with_evals:
            log.log_eval(step + 1, {PASS: reward(step) / 10}, {})
        log.log(step, {REWARD: reward(step), "perf/step_time": 1.0})


def test_wandb_gets_every_rollout_and_eval_against_its_step_metric(tmp_path, monkeypatch):
    """The eval after rollout k is tagged k + 1 and logged before rollout k's metrics: with
    `step=` wandb dropped rollout k's. Each metric is plotted against rollout/step or eval/step."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log = logger(tmp_path, use_wandb=True)
    log.log_eval(0, {PASS: 0.0}, {})  # before the first step
    run_steps(log, (0, 1), reward=float)
    log.close()
    assert wandb.dropped == []
    assert wandb.chart(REWARD) == [(0, 0.0), (1, 1.0)]
    assert wandb.chart(PASS) == [(0, 0.0), (1, 0.0), (2, 0.1)]
    assert wandb.axes == {ROLLOUT_STEP: None, EVAL_STEP: None, REWARD: ROLLOUT_STEP, "perf/step_time": ROLLOUT_STEP,
                          PASS: EVAL_STEP}


def test_wandb_keeps_the_steps_a_trainer_recovery_runs_again(tmp_path, monkeypatch):
    """After a rewind to the checkpoint of rollout 1, rollouts 2 and 3 come again; with `step=`
    wandb dropped them (lower than 3) until the run passed step 3."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log = logger(tmp_path, use_wandb=True)
    run_steps(log, range(4), reward=float)
    log.rewind(1)
    run_steps(log, (2, 3), reward=lambda s: 10.0 + s)
    log.close()
    assert wandb.dropped == []
    assert wandb.chart(REWARD) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (2, 12.0), (3, 13.0)]


def test_a_resumed_run_goes_on_in_its_wandb_run(tmp_path, monkeypatch):
    """--load (start_step > 0) in the same run dir: wandb resumes the run whose id the first
    logger left there, and the steps logged again are kept."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log = logger(tmp_path, use_wandb=True)
    run_steps(log, range(3), reward=float, with_evals=False)
    log.close()
    trim_metrics(tmp_path, 0)
    log = logger(tmp_path, use_wandb=True, start_step=1, resumed=True)
    run_steps(log, (1, 2), reward=lambda s: 10.0 + s, with_evals=False)
    log.close()
    assert wandb.inits == [dict(id=None, resume=None), dict(id="run1", resume="allow")]
    assert wandb.chart(REWARD) == [(0, 0.0), (1, 1.0), (2, 2.0), (1, 11.0), (2, 12.0)]
    (tmp_path / "wandb_run_id").write_text("")  # written by no version of this code, but a disk can
    logger(tmp_path, use_wandb=True, start_step=1, resumed=True).close()
    assert wandb.inits[-1] == dict(id=None, resume=None)  # a new run, not wandb's "Run ID cannot be empty"


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    """(step, value) of `tag` as tensorboard shows it: its reader purges what a writer's
    purge_step hides (SessionLog.START, purge_orphaned_data)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def test_tensorboard_shows_each_step_once_after_a_rewind_and_a_resume(tmp_path):
    """A rewind (trainer recovery) and a --load resume reopen the writer with purge_step: the
    abandoned steps are hidden, the eval of the checkpointed weights (tagged with the next
    step, kept in metrics.jsonl) is written again, and the steps run again show their new values."""
    log = logger(tmp_path, use_tensorboard=True)
    run_steps(log, range(4), reward=float)
    log.rewind(1)  # back to the checkpoint of rollout 1
    run_steps(log, (2, 3, 4), reward=lambda s: 10.0 + s)
    log.close()
    assert scalars(tmp_path, REWARD) == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0), (4, 14.0)]
    assert scalars(tmp_path, PASS) == [(1, 0.0), (2, 0.1), (3, 1.2), (4, 1.3), (5, 1.4)]

    trim_metrics(tmp_path, 2)  # the run crashed; --load the checkpoint of rollout 2 (ppo.state.checkpoint.resume)
    log = logger(tmp_path, use_tensorboard=True, start_step=3, resumed=True)
    run_steps(log, (3,), reward=lambda s: 20.0 + s)
    log.close()
    assert scalars(tmp_path, REWARD) == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 23.0)]
    assert scalars(tmp_path, PASS) == [(1, 0.0), (2, 0.1), (3, 1.2), (4, 2.3)]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 0, 2, 1, 3, 2, 4, 3]  # each rollout's eval line before its own

    (tmp_path / "metrics.jsonl").unlink()  # a resumed run at step 0 (ppo.state.rundir lets it only into a run dir without metrics)
    log = logger(tmp_path, use_tensorboard=True, start_step=0, resumed=True)
    run_steps(log, (0,), reward=lambda s: 30.0 + s)
    log.close()
    assert scalars(tmp_path, REWARD) == [(0, 30.0)]
