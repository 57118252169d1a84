"""Where a run's numbers go: metrics.jsonl, the event bus (`metrics`, and the driver's
`phase` spans), optional tensorboard / wandb, sample dumps, and the console (ppo.observe.console:
a progress bar, plain lines or json, fitted to where the output goes)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ppo.observe.console import RunConsole
from ppo.observe.metrics_file import read_metrics, trim_metrics
from ppo.observe.trace import StepPhases


ROLLOUT_STEP, EVAL_STEP = "rollout/step", "eval/step"  # wandb's step metrics, as miles names them
WANDB_ID_FILE = "wandb_run_id"


class RunLogger:
    def __init__(self, run_dir: Path, *, num_rollout: int, publish, console: RunConsole,
                 use_tensorboard: bool = False, use_wandb: bool = False, wandb_project: str | None = None,
                 dump_samples: bool = True, config: dict | None = None, start_step: int = 0,
                 resumed: bool = False):
        self.run_dir = run_dir
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._publish = publish
        self._dump = dump_samples
        self._tb = self._wandb = None
        if use_tensorboard:
            # resumed (--load): what the earlier run logged from start_step on is hidden
            self._open_tensorboard(purge_step=start_step if resumed else None)
        if use_wandb:
            import wandb  # needs the `logging` extra
            # a --load resume goes on in the run's wandb run (whose id it left here), as miles'
            # --wandb-run-id does
            id_file = run_dir / WANDB_ID_FILE
            run_id = (id_file.read_text().strip() or None) if resumed and start_step and id_file.exists() else None
            self._wandb = wandb.init(project=wandb_project or "tandem", dir=str(run_dir), config=config,
                                     id=run_id, resume="allow" if run_id else None)
            tmp = id_file.with_name(f".{WANDB_ID_FILE}.tmp")
            tmp.write_text(self._wandb.id)
            os.replace(tmp, id_file)  # never a torn id for the next --load
            for axis in (ROLLOUT_STEP, EVAL_STEP):  # step metrics are declared first, as wandb's docs do
                self._wandb.define_metric(axis)
            self._wandb_axes: set[str] = set()  # metrics given their step metric (_log_wandb)
        self.console = console
        self.history: list[dict] = []
        self.eval_history: list[dict] = []  # one record per eval (log_eval)
        self.step = start_step  # the rollout step under way
        self._step_t0 = 0.0
        console.start_training(num_rollout, start_step)

    def step_phases(self, step: int) -> StepPhases:
        """Rollout `step` begins: its perf/*_time seconds, filled by `with perf.phase(name):`."""
        self.step, self._step_t0 = step, time.monotonic()
        self._publish("phase", phase="step", action="begin", track="driver", step=step)
        return StepPhases(step, self._publish, self.console.phase)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.history.append({"step": step, **metrics})
        self._publish("phase", phase="step", action="end", track="driver", step=step,
                      seconds=round(time.monotonic() - self._step_t0, 6))
        self._publish("metrics", step=step, metrics=metrics)
        self._write(step, metrics)
        self.console.rollout(step, metrics)

    def log_eval(self, step: int, metrics: dict[str, float], samples: dict[str, list[dict]]) -> None:
        """An eval's metrics (ppo.generate.evaluation): their own line of metrics.jsonl, tagged with `step`,
        tensorboard/wandb and the console; each set's samples go to samples/eval_NAME_STEP.jsonl.
        Eval lines stay out of `history` (one record per rollout)."""
        metrics = {k: float(v) for k, v in metrics.items()}
        self.eval_history.append({"step": step, **metrics})
        self._write(step, metrics, axis=EVAL_STEP)
        self.console.eval(step, metrics)
        for name, set_samples in samples.items():
            self.dump_samples(step, set_samples, prefix=f"eval_{name}")

    def _write(self, step: int, metrics: dict[str, float], axis: str = ROLLOUT_STEP) -> None:
        """One line of metrics.jsonl, and tensorboard / wandb (`axis`: the wandb step metric)."""
        self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            self._add_scalars(step, metrics)
        if self._wandb is not None:
            self._log_wandb(step, metrics, axis)

    def _add_scalars(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._tb.add_scalar(k, v, step)

    def _log_wandb(self, step: int, metrics: dict[str, float], axis: str) -> None:
        """Each metric is plotted against its own step metric (miles' rollout/step and
        eval/step), never wandb's `step=`: wandb drops a step lower than one it has seen, and
        the loop logs lower ones twice: an eval after rollout k, tagged k + 1, comes before
        rollout k's metrics, and after a trainer recovery the rewound steps come again."""
        for name in metrics.keys() - self._wandb_axes:
            self._wandb.define_metric(name, step_metric=axis)
            self._wandb_axes.add(name)
        self._wandb.log({axis: step, **metrics})

    def _open_tensorboard(self, purge_step: int | None) -> None:
        """The tensorboard writer. With `purge_step`, tensorboard's event reader hides every
        event an earlier writer logged at that step or later (the run logs them again); its
        fast loader (the Rust data server, --load_fast) instead replaces a tag's points from
        the step that tag is logged at again. The eval records that metrics.jsonl keeps at
        that step (ppo.observe.metrics_file.trim_metrics) are written anew."""
        from torch.utils.tensorboard import SummaryWriter  # needs the `logging` extra

        self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge_step)
        if purge_step is not None:
            for record in read_metrics(self.run_dir):
                if record.pop("step") == purge_step:
                    self._add_scalars(purge_step, record)

    def rewind(self, last_step: int) -> None:
        """The run goes back to after `last_step` (ppo.recovery): metrics of later steps are
        dropped from metrics.jsonl, the history and tensorboard, and will be logged again.
        wandb cannot drop them: the rewound steps' points stay, and the new ones follow."""
        self._metrics.close()
        trim_metrics(self.run_dir, last_step)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.history = [h for h in self.history if h["step"] <= last_step]
        self.eval_history = [h for h in self.eval_history if h["step"] <= last_step + 1]  # as trim_metrics
        if self._tb is not None:
            self._tb.close()
            self._open_tensorboard(purge_step=last_step + 1)

    def dump_samples(self, step: int, samples: list[dict], prefix: str = "rollout") -> None:
        if not self._dump:
            return
        write_samples(self.run_dir / "samples" / f"{prefix}_{step:05d}.jsonl", samples)

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self.console.close(self.history)


def write_samples(path: Path, samples: list[dict]) -> None:
    """Samples as jsonl: prompt, response, label, reward and how each ended; a multi-turn
    trajectory's turns one by one ({"source": "model" | "env", "text"})."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({k: s[k] for k in ("index", "group_index", "prompt", "response", "label",
                                                  "reward", "reward_status", "finish_reason",
                                                  "weight_version")}
                               # the reward's parts, when a reward model or a post-process made it (ppo.generate.rewards);
                               # a multi-turn trajectory's turns, model and environment (ppo.generate)
                               # and the request a generate function's samples came from (its records share it)
                               | {k: s[k] for k in ("rm_score", "raw_reward", "turns", "stats", "session") if k in s})
                    + "\n")
