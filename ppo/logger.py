"""Where a run's numbers go: metrics.jsonl, the event bus, optional tensorboard / wandb,
sample dumps, and the progress bar with its end-of-run summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table


class RunLogger:
    def __init__(self, run_dir: Path, *, num_rollout: int, publish, use_tensorboard: bool = False,
                 use_wandb: bool = False, wandb_project: str | None = None, dump_samples: bool = True,
                 config: dict | None = None, start_step: int = 0):
        self.run_dir = run_dir
        self._metrics = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self._publish = publish
        self._dump = dump_samples
        self._tb = self._wandb = None
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `logging` extra
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if use_wandb:
            import wandb  # needs the `logging` extra
            self._wandb = wandb.init(project=wandb_project or "tandem", dir=str(run_dir), config=config)
        self.console = Console(stderr=True)
        self.history: list[dict] = []
        self._progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                  console=self.console, transient=False)
        self._task = self._progress.add_task("ppo", total=num_rollout, completed=start_step, status="")
        self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        record = {"step": step, **metrics}
        self.history.append(record)
        self._metrics.write(json.dumps(record) + "\n")
        self._publish("metrics", step=step, metrics=metrics)
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        status = (f"reward {metrics.get('rollout/raw_reward', math.nan):.3f}  "
                  f"step {metrics.get('perf/step_time', math.nan):.2f}s")
        self._progress.update(self._task, completed=step + 1, status=status)

    def dump_samples(self, step: int, samples: list[dict]) -> None:
        if not self._dump:
            return
        d = self.run_dir / "samples"
        d.mkdir(exist_ok=True)
        with open(d / f"rollout_{step:05d}.jsonl", "w") as f:
            for s in samples:
                f.write(json.dumps({k: s[k] for k in ("index", "group_index", "prompt", "response", "label",
                                                      "reward", "reward_status", "finish_reason",
                                                      "weight_version")}) + "\n")

    def close(self) -> None:
        self._progress.stop()
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self.history:
            self.console.print(summary_table(self.history))


def summary_table(history: list[dict], window: int = 5) -> Table:
    """First and last `window` rollouts side by side for the headline metrics."""
    keys = ["rollout/raw_reward", "rollout/response_len", "train/pg_loss", "train/critic-value_loss",
            "train/ppo_kl", "train/grad_norm", "perf/step_time"]
    first, last = history[:window], history[-window:]
    table = Table(title=f"PPO summary: {len(history)} rollouts (mean of first / last {len(first)})")
    for col in ("metric", "first", "last"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for k in keys:
        a = [r[k] for r in first if k in r]
        b = [r[k] for r in last if k in r]
        if a and b:
            table.add_row(k, f"{sum(a) / len(a):.4g}", f"{sum(b) / len(b):.4g}")
    return table
