"""What a run prints, fitted to where it goes.

    rich   (a terminal)  start-up stages with a spinner, a progress bar, the summary table
    plain  (a file, a pipe, nohup, Slurm)  one line per start-up stage and per rollout, e.g.
           `[ppo] step=3/20 reward=0.1250 response_len=2.00 step_time=1.23s elapsed=4s eta=21s`,
           and a `[ppo] step=... running phase=...` line whenever `log_interval_s` passed
           without one (long steps); an eval prints one `[eval] step=S NAME reward=...` per set
    json   one JSON object per line with a "type": startup (a stage and its seconds; the wait
           for the roles adds each role's spawn-to-ready seconds), rollout (step, all metrics,
           eta_s), eval (step, its metrics), progress (the periodic line), done (the summary)
    quiet  nothing; errors still reach stderr from whoever raises them

Everything goes to stdout. `--log-format auto` (the default) picks rich when stdout is a
terminal and plain otherwise. Files (metrics.jsonl, trace.json) are written either way.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

# the per-rollout line: (label, metric key, format)
LINE_FIELDS = (("reward", "rollout/raw_reward", ".4f"), ("response_len", "rollout/response_len", ".2f"),
               ("step_time", "perf/step_time", ".2f"))
SUMMARY_KEYS = ("rollout/raw_reward", "rollout/response_len", "train/pg_loss", "train/critic-value_loss",
                "train/ppo_kl", "train/grad_norm", "perf/step_time")


class RunConsole:
    """The run's printed output. Start-up calls `begin(stage)` for each stage (the next
    `begin` or `end_stage` closes the one before and prints its time); training calls
    `start_training`, `phase`, `rollout` and `eval`; `close` prints the summary."""

    def __init__(self, mode: str, *, out: TextIO | None = None, log_interval_s: float = 30.0):
        if mode not in ("rich", "plain", "json", "quiet"):
            raise ValueError(f"mode={mode!r} must be one of: rich, plain, json, quiet")
        self.mode = mode
        self.out = out or sys.stdout
        self.interval = log_interval_s
        self._lock = threading.Lock()
        self._stage: tuple[str, float] | None = None
        self._status = None  # rich spinner of the running stage
        self._progress: Progress | None = None
        self._rich = Console(file=self.out) if mode == "rich" else None
        self._num_rollout = self._first_step = 0
        self._t_first: float | None = None
        self._step: int | None = None
        self._phase: tuple[str, float] | None = None
        self._last_line = time.monotonic()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    @classmethod
    def for_config(cls, cfg) -> RunConsole:
        """The console `cfg.logging` asks for; auto is rich on a terminal, plain otherwise."""
        log = cfg.logging
        mode = "quiet" if log.quiet else log.log_format
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        return cls(mode, log_interval_s=log.log_interval_s)

    # -- start-up ------------------------------------------------------------------------
    def begin(self, stage: str) -> None:
        """Start-up is now doing `stage` (ends the stage before)."""
        self.end_stage()
        self._stage = (stage, time.monotonic())
        if self.mode == "rich":
            self._status = self._rich.status(f"{stage} ...")
            self._status.start()
        elif self.mode == "plain":
            self._print(f"[startup] {stage} ...")

    def end_stage(self, **details) -> None:
        """The running stage is done: print how long it took (and `details` in json)."""
        if self._stage is None:
            return
        stage, t0 = self._stage
        self._stage, seconds = None, time.monotonic() - t0
        if self._status is not None:
            self._status.stop()
            self._status = None
        if self.mode == "rich":
            self._rich.print(f"[green]done[/] {stage} [dim]{seconds:.2f} s[/]")
        elif self.mode == "plain":
            self._print(f"[startup] {stage}: done in {seconds:.2f} s")
        elif self.mode == "json":
            self._json({"type": "startup", "stage": stage, "seconds": round(seconds, 3), **details})

    def roles_ready(self, seconds_by_role: dict[str, float]) -> None:
        """End the wait for the roles, with each role's time from spawn to ready."""
        self.end_stage(roles={k: round(v, 3) for k, v in seconds_by_role.items()})
        for role, seconds in seconds_by_role.items():
            if self.mode == "rich":
                self._rich.print(f"     [dim]{role} ready {seconds:.2f} s after spawn[/]")
            elif self.mode == "plain":
                self._print(f"[startup] {role} ready {seconds:.2f} s after spawn")

    # -- training ------------------------------------------------------------------------
    def start_training(self, num_rollout: int, start_step: int) -> None:
        self.end_stage()
        self._num_rollout, self._first_step = num_rollout, start_step
        self._t_first = time.monotonic()
        if self.mode == "rich":
            self._progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[status]}"), TimeRemainingColumn(),
                                      console=self._rich, transient=False)
            self._task = self._progress.add_task("ppo", total=num_rollout, completed=start_step, status="")
            self._progress.start()
        elif self.mode in ("plain", "json"):
            self._ticker = threading.Thread(target=self._tick, name="tandem-console", daemon=True)
            self._ticker.start()

    def phase(self, step: int, name: str) -> None:
        """The driver entered phase `name` of rollout `step` (for the periodic line)."""
        with self._lock:
            self._step, self._phase = step, (name, time.monotonic())

    def rollout(self, step: int, metrics: dict[str, float]) -> None:
        """Rollout `step` is done (0-based) with these metrics."""
        done = step + 1
        eta = self._eta(done)
        if self.mode == "rich":
            status = (f"reward {metrics.get('rollout/raw_reward', math.nan):.3f}  "
                      f"step {metrics.get('perf/step_time', math.nan):.2f}s")
            self._progress.update(self._task, completed=done, status=status)
        elif self.mode == "plain":
            fields = " ".join(f"{label}={metrics.get(key, math.nan):{fmt}}" + ("s" if label == "step_time" else "")
                              for label, key, fmt in LINE_FIELDS)
            self._print(f"[ppo] step={done}/{self._num_rollout} {fields} "
                        f"elapsed={self._elapsed():.0f}s eta={eta:.0f}s")
        elif self.mode == "json":
            self._json({"type": "rollout", "step": step, "num_rollout": self._num_rollout,
                        "elapsed_s": round(self._elapsed(), 3), "eta_s": round(eta, 3), "metrics": metrics})

    def eval(self, step: int, metrics: dict[str, float]) -> None:
        """An eval tagged `step` (ppo.generate.evaluation) is done: one line per set."""
        if self.mode == "json":
            self._json({"type": "eval", "step": step, "metrics": metrics})
            return
        for line in eval_lines(step, metrics):
            if self.mode == "rich":
                self._rich.print(line)
            elif self.mode == "plain":
                self._print(line)

    def close(self, history: list[dict]) -> None:
        """Stop the bar and the periodic line; print the summary of `history`."""
        self.end_stage()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if not history:
            return
        first, last = summary_windows(history)
        if self.mode == "rich":
            self._rich.print(summary_table(history))
        elif self.mode == "plain":
            if not first:
                self._print(f"[summary] {len(history)} rollout: no first and last rollouts to compare")
            for key, a, b in summary_rows(history):
                self._print(f"[summary] {key} first={a:.4g} last={b:.4g} "
                            f"(means of {rollouts(first)} and of {rollouts(last)})")
        elif self.mode == "json":
            self._json({"type": "done", "rollouts": len(history), "elapsed_s": round(self._elapsed(), 3),
                        "summary": {k: {"first": a, "last": b} for k, a, b in summary_rows(history)},
                        "first_steps": [r["step"] for r in first], "last_steps": [r["step"] for r in last]})

    # -- helpers -------------------------------------------------------------------------
    def _elapsed(self) -> float:
        return time.monotonic() - self._t_first if self._t_first is not None else 0.0

    def _eta(self, done: int) -> float:
        """Seconds left at the mean step time of this process's steps."""
        steps = done - self._first_step
        return self._elapsed() / steps * (self._num_rollout - done) if steps > 0 else math.nan

    def _tick(self) -> None:
        """Plain/json: a progress line whenever `interval` passed without any line."""
        while not self._stop.wait(min(1.0, self.interval)):
            with self._lock:
                quiet_for = time.monotonic() - self._last_line
                step, phase = self._step, self._phase
            if quiet_for < self.interval or step is None:
                continue
            name, since = phase
            if self.mode == "plain":
                self._print(f"[ppo] step={step + 1}/{self._num_rollout} running phase={name} "
                            f"for {time.monotonic() - since:.0f}s elapsed={self._elapsed():.0f}s")
            else:
                self._json({"type": "progress", "step": step, "phase": name,
                            "phase_s": round(time.monotonic() - since, 3), "elapsed_s": round(self._elapsed(), 3)})

    def _print(self, line: str) -> None:
        with self._lock:
            self.out.write(line + "\n")
            self.out.flush()  # a pipe is block-buffered: a line must show when it happens
            self._last_line = time.monotonic()

    def _json(self, record: dict) -> None:
        self._print(json.dumps(record, default=float))


def eval_lines(step: int, metrics: dict[str, float]) -> list[str]:
    """'[eval] step=S NAME reward=... pass@1=... pass@K=... response_len=... truncated=...' per set."""
    names = [k.removeprefix("eval/").removesuffix("-truncated_ratio") for k in metrics
             if k.startswith("eval/") and k.endswith("-truncated_ratio")]
    lines = []
    for name in names:
        pass_ks = sorted((int(k.rsplit("@", 1)[1]), v) for k, v in metrics.items()
                         if k.startswith(f"eval/{name}-pass@"))
        passes = " ".join(f"pass@{k}={v:.3f}" for k, v in pass_ks[:1] + pass_ks[1:][-1:])
        lines.append(f"[eval] step={step} {name} reward={metrics[f'eval/{name}']:.4f} {passes} "
                     f"response_len={metrics.get(f'eval/{name}/response_len/mean', math.nan):.2f} "
                     f"truncated={metrics.get(f'eval/{name}-truncated_ratio', math.nan):.3f}")
    return lines


def summary_windows(history: list[dict], window: int = 5) -> tuple[list[dict], list[dict]]:
    """The first and the last `window` rollouts of `history`, never the same ones: a run
    shorter than 2 x window is split in halves (an odd count leaves its middle rollout out),
    and a single rollout has no pair to compare ([], [])."""
    w = min(window, len(history) // 2)
    return (history[:w], history[-w:]) if w else ([], [])


def rollouts(records: list[dict]) -> str:
    """'rollouts 0-4' (their steps; a resumed run's first step is not 0), or 'rollout 3'."""
    steps = [r["step"] for r in records]
    return f"rollout {steps[0]}" if len(steps) == 1 else f"rollouts {steps[0]}-{steps[-1]}"


def summary_rows(history: list[dict], window: int = 5) -> list[tuple[str, float, float]]:
    """(metric, mean over the first rollouts, mean over the last) for the headline metrics,
    over summary_windows(history, window)."""
    first, last = summary_windows(history, window)
    rows = []
    for k in SUMMARY_KEYS:
        a = [r[k] for r in first if k in r]
        b = [r[k] for r in last if k in r]
        if a and b:
            rows.append((k, sum(a) / len(a), sum(b) / len(b)))
    return rows


def summary_table(history: list[dict], window: int = 5) -> Table:
    """First and last rollouts (summary_windows) side by side for the headline metrics."""
    first, last = summary_windows(history, window)
    span = f"first: mean of {rollouts(first)}; last: mean of {rollouts(last)}" if first else "too few to compare"
    table = Table(title=f"PPO summary: {len(history)} rollouts ({span})")
    for col in ("metric", "first", "last"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for k, a, b in summary_rows(history, window):
        table.add_row(k, f"{a:.4g}", f"{b:.4g}")
    return table


def ready_seconds(events: list[dict]) -> dict[str, float]:
    """Each role's seconds from its (last) spawn to its ready event, from the event log."""
    spawned, ready = {}, {}
    for e in events:
        if e["event"] == "spawned":
            spawned[e["role"]] = e["ts"]
        elif e["event"] == "ready" and e["role"] in spawned:
            ready[e["role"]] = e["ts"] - spawned[e["role"]]
    return ready
