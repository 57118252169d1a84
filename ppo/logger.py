"""Where a run's numbers go: metrics.jsonl, the event bus (`metrics`, and the driver's
`phase` spans), optional tensorboard / wandb, sample dumps, and the console (ppo.console:
a progress bar, plain lines or json, fitted to where the output goes)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ppo.checkpoint import trim_metrics
from ppo.console import RunConsole
from ppo.trace import StepPhases


class RunLogger:
    def __init__(self, run_dir: Path, *, num_rollout: int, publish, console: RunConsole,
                 use_tensorboard: bool = False, use_wandb: bool = False, wandb_project: str | None = None,
                 dump_samples: bool = True, config: dict | None = None, start_step: int = 0):
        self.run_dir = run_dir
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._publish = publish
        self._dump = dump_samples
        self._tb = self._wandb = None
        # wandb ignores a step lower than one it has seen, and an eval after rollout k is tagged
        # k + 1 and logged before rollout k's metrics: its wandb record waits for step k + 1's
        self._wandb_pending: dict[int, dict[str, float]] = {}
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `logging` extra
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if use_wandb:
            import wandb  # needs the `logging` extra
            self._wandb = wandb.init(project=wandb_project or "tandem", dir=str(run_dir), config=config)
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
        """An eval's metrics (ppo.evaluation): their own line of metrics.jsonl, tagged with `step`,
        tensorboard/wandb and the console; each set's samples go to samples/eval_NAME_STEP.jsonl.
        Eval lines stay out of `history` (one record per rollout)."""
        metrics = {k: float(v) for k, v in metrics.items()}
        self.eval_history.append({"step": step, **metrics})
        self._write(step, metrics, wandb_now=False)
        self.console.eval(step, metrics)
        for name, set_samples in samples.items():
            self.dump_samples(step, set_samples, prefix=f"eval_{name}")

    def _write(self, step: int, metrics: dict[str, float], wandb_now: bool = True) -> None:
        """One line of metrics.jsonl, and tensorboard / wandb (`wandb_now` False: an eval's,
        held until rollout `step` is logged, or the run closes)."""
        self._metrics.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            held = self._wandb_pending.pop(step, {})
            if wandb_now:
                self._wandb.log({**held, **metrics}, step=step)
            else:
                self._wandb_pending[step] = {**held, **metrics}

    def rewind(self, last_step: int) -> None:
        """The run goes back to after `last_step` (ppo.recovery): metrics of later steps are
        dropped from metrics.jsonl and the history, and will be logged again."""
        self._metrics.close()
        trim_metrics(self.run_dir, last_step)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.history = [h for h in self.history if h["step"] <= last_step]
        self.eval_history = [h for h in self.eval_history if h["step"] <= last_step + 1]  # as trim_metrics
        self._wandb_pending = {k: v for k, v in self._wandb_pending.items() if k <= last_step + 1}

    def dump_samples(self, step: int, samples: list[dict], prefix: str = "rollout") -> None:
        if not self._dump:
            return
        write_samples(self.run_dir / "samples" / f"{prefix}_{step:05d}.jsonl", samples)

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            for step in sorted(self._wandb_pending):  # evals after the last rollout logged
                self._wandb.log(self._wandb_pending[step], step=step)
            self._wandb.finish()
        self.console.close(self.history)


def write_samples(path: Path, samples: list[dict]) -> None:
    """Samples as jsonl: prompt, response, label, reward and how each ended."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for s in samples:
            f.write(json.dumps({k: s[k] for k in ("index", "group_index", "prompt", "response", "label",
                                                  "reward", "reward_status", "finish_reason",
                                                  "weight_version")}
                               # the reward's parts, when a reward model or a post-process made it (ppo.rewards)
                               | {k: s[k] for k in ("rm_score", "raw_reward") if k in s}) + "\n")
