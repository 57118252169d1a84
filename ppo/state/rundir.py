"""The run directory's claim: one live run per --run-dir, and no silent reuse of an old one.

A run takes an exclusive flock on RUN_DIR/.lock before it writes anything there and holds it
until it ends (the kernel drops it when the process dies, however it dies). A second run on
the same folder is refused while the lock is held, before it has touched a file. A folder
that an earlier run (finished, failed or killed) has logged to is refused too unless the run
resumes with --load: appending a new run's step 0 to the old run's metrics would mix two runs.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ppo.config import PPOConfig

LOCK_FILE = ".lock"
# what a run that got as far as starting its roles leaves behind (config.json and generated
# data are written earlier, by runs that may have stopped at a bad input: those may be reused)
RUN_FILES = ("metrics.jsonl", "events.jsonl", "supervisor.json")


class RunDirError(ValueError):
    """--run-dir cannot be used by this run; the message names the folder and the way out."""


class RunDirLock:
    """The claim on one run directory; `release()` (or the process's end) gives it up."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self._fd = run_dir, fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def claim(cfg: PPOConfig) -> RunDirLock:
    """Make and lock cfg.logging.run_dir; RunDirError if a live run holds it, or an earlier run
    logged there and this one does not resume with --load."""
    run_dir = Path(cfg.logging.run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise RunDirError(f"--run-dir {run_dir}: cannot be used ({e.strerror or e}); "
                          "pass a folder this user can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_pid(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise RunDirError(f"--run-dir {run_dir}: cannot be locked ({e.strerror})") from None
        raise RunDirError(f"--run-dir {run_dir} is in use by a live run{f' (pid {holder})' if holder else ''}; "
                          "wait for it to end, or pass another --run-dir") from None
    old = [name for name in RUN_FILES if (run_dir / name).exists()]
    if old and cfg.checkpoint.load is None:
        os.close(fd)
        save = f" --load {cfg.checkpoint.save}" if cfg.checkpoint.save else " --load SAVE_DIR"
        raise RunDirError(f"--run-dir {run_dir} holds an earlier run ({', '.join(old)}); resume it with{save}, "
                          "or pass a new --run-dir to start another run")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the refusal of a second run
    return RunDirLock(run_dir, fd)


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
