"""A role process as the supervisor knows it (its spec and its current incarnation), and the
OS chores around it: starting with an environment, reading how it ended, killing its process
group, reading its error file."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESTART_POLICIES = ("one_for_one", "one_for_all", "temporary")


@dataclass(frozen=True)
class ChildSpec:
    name: str
    cls: type
    init_frames: list[bytes]
    gpus: tuple[int, ...]
    restart: str  # one of RESTART_POLICIES
    group: str | None
    env: dict[str, str]
    # Spawned holding the leases of all its GPUs: it allocates there while starting (an
    # engine loads its weights), so a restart waits until it holds them again.
    lease_to_start: bool = False


@dataclass
class Child:
    spec: ChildSpec
    incarnation: int
    process: Any = None
    endpoint: str = ""
    state: str = "starting"  # starting -> ready -> dead
    started_at: float = field(default_factory=time.monotonic)
    last_beat: float | None = None
    stats: dict = field(default_factory=dict)
    ever_ready: bool = False
    restarts: int = 0
    ps: Any = None  # psutil.Process of the current incarnation, for role_stats

    @property
    def endpoint_id(self) -> str:
        return f"{self.spec.name}#{self.incarnation}"

_env_lock = threading.Lock()  # os.environ is patched around Process.start()


def start_with_env(proc, env: dict[str, str]) -> None:
    with _env_lock:  # the spawned interpreter inherits os.environ: set it before any import
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def exit_reason(proc) -> str:
    proc.join(timeout=1)
    code = proc.exitcode
    if code is None:
        return "process ended"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def kill_tree(pid: int) -> None:
    """SIGKILL a child and everything in its session (it is a session leader)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_session_but_self(timeout_s: float = 2.0) -> None:
    """SIGKILL every other process of this process's session: what a role started and left
    (a role is a session leader, runtime.child). Repeated until none is left (a process that
    forks between the listing and the kill would otherwise escape), at most `timeout_s`."""
    end_session(os.getsid(0), timeout_s, spare=os.getpid())


def end_session(session: int, timeout_s: float = 10.0, spare: int | None = None) -> None:
    """SIGKILL what is left of session `session` (a dead role's: what it started, e.g. an
    inference server's scheduler, which may still hold GPU memory), but `spare`, and wait, at
    most `timeout_s`, until none of it runs (zombies hold no memory). A process that may not be
    signalled (EPERM: another user's, e.g. a setuid helper) is left alone and not waited for:
    this runs in the supervisor's watcher thread, which must never die of it."""
    deadline = time.monotonic() + timeout_s
    untouchable: set[int] = set()
    while True:
        left = [pid for pid in _session_members(session) if pid != spare and pid not in untouchable]
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except PermissionError:
                untouchable.add(pid)
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _session_members(session: int) -> list[int]:
    """Live (not zombie) processes of `session`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != session:
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            members.append(int(entry))
    return members


def read_text(path: str, limit: int = 20000) -> str | None:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    return text[-limit:] if text.strip() else None
