"""The run directory's claim: one live run per --run-dir, and no silent reuse of an old one.

A run takes an exclusive flock on RUN_DIR/.lock before it writes anything there and holds it
until it ends (the kernel drops it when the process dies, however it dies). A second run on
the same folder is refused while the lock is held, before it has touched a file. A folder
that an earlier run (finished, failed or killed) has logged to is used only by a --load
resume of that same run: its newest checkpoint must have been written with this --run-dir
(driver_state.json keeps the run's config). A plain rerun, a --load of a folder with no
checkpoint or of another run's, would start over on the earlier run's metrics and samples.
A --load that does not exist, or whose newest checkpoint leaves no rollout to run, is refused
before the run dir is even made (`load_problem`), and so is a --save folder holding another
run's checkpoints, which this run's saves would overwrite and prune.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from ppo.state.checkpoint import newest_state, saved_names
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
    problem = _earlier_run_problem(cfg, run_dir, old) if old else None
    if problem:
        os.close(fd)
        raise RunDirError(problem)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the refusal of a second run
    return RunDirLock(run_dir, fd)


def load_problem(cfg: PPOConfig) -> str | None:
    """Why --load cannot be resumed from or --save not saved to, seen before anything is
    written, or None: see `_load_problem` and `_save_problem`."""
    return _load_problem(cfg) or _save_problem(cfg)


def _load_problem(cfg: PPOConfig) -> str | None:
    """Why --load cannot be resumed from, or None: a path that does not exist (a typo would
    otherwise start a new run) or is not a folder, or a newest checkpoint after which
    --num-rollout leaves nothing to run (a finished run). --load and --save on one folder
    that does not exist yet is miles' first run of a job (its recipes pass both): --save
    makes it, and the run starts from --hf-checkpoint."""
    load, save = cfg.checkpoint.load, cfg.checkpoint.save
    if load is None:
        return None
    if not os.path.exists(load) and save is not None and os.path.abspath(save) == os.path.abspath(load):
        return None
    if not os.path.exists(load):
        return (f"--load {load}: no such folder; pass the --save folder of the run to resume, or leave "
                "--load out to start a new run (or give --save the same folder, as miles' recipes do)")
    if not os.path.isdir(load):
        return f"--load {load}: not a folder; pass the --save folder of the run to resume"
    state = newest_state(load)
    step = state.get("rollout_step") if state else None
    if isinstance(step, int) and step + 1 >= cfg.rollout.num_rollout:
        return (f"--load {load}: its newest checkpoint is after rollout {step}, and --num-rollout "
                f"{cfg.rollout.num_rollout} leaves nothing to run; raise --num-rollout to train on")
    return None


def _save_problem(cfg: PPOConfig) -> str | None:
    """Why --save may not take this run's checkpoints, or None: it holds another run's
    (`latest`, rollout_NNNNN), which this run's saves would overwrite (same step), repoint
    (`latest`) and prune. They are this run's only when it resumes from them: --load is the
    same folder and their newest was written with this --run-dir (miles' recipes pass one
    folder to both; on a job's first run it is empty)."""
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    held = saved_names(save) if save is not None else []
    if not held:
        return None
    what = f"--save {save} holds an earlier run's checkpoints ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
    if load is None or os.path.abspath(load) != os.path.abspath(save):
        start = "this run starts anew" if load is None else f"this run starts from --load {load}"
        return (f"{what}, and {start}: its saves would overwrite and prune them; pass an empty --save folder, "
                f"or resume that run with --load {save}")
    wrote = _written_run_dir(newest_state(save))
    if wrote is not None and Path(wrote).resolve() != Path(cfg.logging.run_dir).resolve():
        return (f"{what}, written with --run-dir {wrote}: this run's saves would overwrite and prune them; "
                f"pass a new --save folder (--load {load} may stay), or resume that run with --run-dir {wrote}")
    return None


def _written_run_dir(state: dict | None) -> str | None:
    """The --run-dir of the run that wrote checkpoint state `state`, or None; absolute
    (ppo.state.checkpoint.driver_state), but in a checkpoint older than that rule."""
    return ((state or {}).get("config") or {}).get("logging", {}).get("run_dir")


def _earlier_run_problem(cfg: PPOConfig, run_dir: Path, old: list[str]) -> str | None:
    """Why this run may not use a run dir holding an earlier run (its files `old`), or None
    when it resumes that run from one of its checkpoints."""
    held = f"--run-dir {run_dir} holds an earlier run ({', '.join(old)})"
    load = cfg.checkpoint.load
    if load is None:
        save = f" --load {cfg.checkpoint.save}" if cfg.checkpoint.save else " --load SAVE_DIR"
        return f"{held}; resume it with{save}, or pass a new --run-dir to start another run"
    state = newest_state(load)
    if state is None:
        return (f"{held}, and --load {load} holds no checkpoint to resume it from (starting over would mix "
                "two runs there); pass that run's --save folder, or a new --run-dir to start another run")
    wrote = _written_run_dir(state)
    if wrote is not None and Path(wrote).resolve() != run_dir.resolve():
        return (f"{held}, and the newest checkpoint under --load {load} is another run's (written with "
                f"--run-dir {wrote}); resume this run from its own --save folder, or pass a new --run-dir "
                "to start from that checkpoint")
    return None


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError):
        return None
