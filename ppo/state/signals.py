"""Signals to the driver: stop at once, or save at the next safe point and then stop.

- SIGINT (Ctrl-C) and SIGTERM stop the run at once: the handler raises RunStopped in the
  driver, whose `finally` blocks stop every role (SIGTERM, grace, SIGKILL), mark
  supervisor.json ended and drop the run dir's lock. A checkpoint being written is left as
  a `.partial` folder and removed; `latest` still names the previous complete one.
- SIGUSR1, and SIGTERM with --save-on-signal, ask for a checkpoint: the rollout under way
  finishes, is saved under --save, and then the run stops (Slurm's `--signal=USR1@120`,
  Kubernetes' and preemptible clouds' SIGTERM before the kill). A Ctrl-C or plain SIGTERM
  while it waits still stops at once.

Either way launch.py prints RunStopped's one line (the rollout, and how to resume) and exits
with 128 + the signal's number. A second signal while the run is stopping is ignored: the
shutdown is bounded by the supervisor's grace period.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
from pathlib import Path

from ppo.state.checkpoint import TRACKER
from ppo.config import PPOConfig


class RunStopped(BaseException):
    """The run was stopped by a signal. A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way up may swallow it."""

    def __init__(self, signum: int, *, step: int | None, save: str | None, saved: str | None = None):
        self.signum, self.step, self.save, self.saved = signum, step, save, saved
        self.exit_code = 128 + signum
        super().__init__(self.message())

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint a resume would read: the one `SAVE/latest` names, if any."""
        if self.save is None:
            return None
        tracker = Path(self.save) / TRACKER
        return tracker.read_text().strip() if tracker.is_file() else None

    def message(self) -> str:
        name = signal.Signals(self.signum).name
        where = "before the first rollout" if self.step is None else f"during rollout {self.step}"
        if self.saved is not None:
            return f"{name}: saved {self.saved} after rollout {self.step} and stopped"
        if self.save is None:
            return f"stopped by {name} {where}; no checkpoint was being written (--save unset): the run must start over"
        if self.checkpoint is None:
            return f"stopped by {name} {where}; no checkpoint was written yet under --save {self.save}"
        return f"stopped by {name} {where}; the last checkpoint is {self.checkpoint} under --save {self.save}"


class SignalStops:
    """The driver's signal handlers for the run's life (a context manager); the loop sets
    `step` and calls `after_step` at the end of every rollout."""

    def __init__(self, cfg: PPOConfig):
        self.save = cfg.checkpoint.save
        self.saving_signals = {signal.SIGUSR1} | ({signal.SIGTERM} if cfg.checkpoint.save_on_signal else set())
        self.step: int | None = None  # the rollout under way
        self.requested: int | None = None  # a signal asking for a save-and-stop
        self._stopping = False
        self._previous: dict[int, object] = {}

    @property
    def save_requested(self) -> bool:
        return self.requested is not None and self.save is not None

    def __enter__(self) -> SignalStops:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def closing(self) -> None:
        """The run is ending: signals from now on are ignored (the shutdown is bounded)."""
        self._stopping = True

    def __exit__(self, *exc) -> None:
        self._stopping = True
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self._stopping:
            return
        if signum in self.saving_signals:
            if self.requested is None:
                self.requested = signum
                what = "saving a checkpoint" if self.save is not None else "no checkpoint (--save unset)"
                print(f"tandem: {signal.Signals(signum).name}: {what} at the end of "
                      f"{'the first rollout' if self.step is None else f'rollout {self.step}'}, then stopping",
                      file=sys.stderr, flush=True)
            return
        self._stopping = True
        raise RunStopped(signum, step=self.step, save=self.save)

    def after_step(self, step: int, *, saved: str | None, last: bool) -> None:
        """RunStopped when a save-and-stop was asked for (the loop has saved `saved` first);
        the last rollout ends the run as usual."""
        if self.requested is None or last:
            return
        self._stopping = True
        raise RunStopped(self.requested, step=step, save=self.save, saved=saved)


def resume_command(argv: list[str], cfg: PPOConfig) -> str:
    """The launch.py command line `argv` with --load SAVE and the run's --run-dir (which a run
    that resumes may log to again) in place of any it had."""
    args = list(argv)
    for flag in ("--load", "--run-dir"):  # drop the old values ("--flag value" and "--flag=value")
        while (i := next((i for i, a in enumerate(args) if a == flag or a.startswith(flag + "=")), None)) is not None:
            del args[i:i + (1 if "=" in args[i] else 2)]
    return shlex.join(["python", "launch.py", *args, "--load", cfg.checkpoint.save, "--run-dir", cfg.logging.run_dir])
