"""What a role started is ended with it: the role's own stop (kill_session_but_self) and the
supervisor's, on a death (`_on_death`) and on a stop (`_stop_children`); neither dies of a
process it may not signal."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from runtime import Actor, Supervisor, endpoint
from runtime import process


def _eperm_for(protected: int):
    real_kill = os.kill

    def kill(pid, sig):
        if pid == protected:  # another user's process, as a non-root supervisor would see it
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)
    return kill


def test_ending_a_session_skips_a_process_it_may_not_signal_and_does_not_wait_for_it(monkeypatch):
    protected = 999_999_999
    monkeypatch.setattr(process, "_session_members", lambda session: [protected])
    monkeypatch.setattr(process.os, "kill", _eperm_for(protected))
    t0 = time.monotonic()
    process.end_session(12345, timeout_s=10.0)
    process.kill_session_but_self(timeout_s=10.0)
    assert time.monotonic() - t0 < 2.0  # not waited for until the timeout


class StartsAServer(Actor):
    """A role that starts a server in a process group of its own (as sglang's launcher may),
    so a kill of the role's group misses it; it records its earlier incarnation's server."""

    def __init__(self, pid_file: str):
        self.pid_file = pid_file
        earlier = int(open(pid_file).read()) if os.path.exists(pid_file) else None
        self.earlier_gone = None if earlier is None else _gone(earlier)
        self.server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
        with open(pid_file, "w") as f:
            f.write(str(self.server.pid))

    @endpoint
    def server_pid(self) -> int:
        return self.server.pid

    @endpoint
    def earlier_server_gone(self) -> bool | None:
        return self.earlier_gone


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _reap(pid: int) -> None:
    """Cleanup when a test failed: the server it started must not outlive it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(60)
def test_a_killed_roles_server_in_its_own_group_is_gone_before_the_restarted_incarnation_starts(run_dir):
    sup = Supervisor(run_dir, heartbeat_interval=0.2, heartbeat_timeout=30.0, shutdown_grace_s=1.0)
    pids = []
    try:
        role = sup.spawn("server", StartsAServer, str(run_dir / "server.pid"))
        pids.append(role.server_pid())
        assert role.earlier_server_gone() is None
        sup.kill("server")  # SIGKILL: the role kills nothing itself; the supervisor ends its session
        sup.wait_restarted("server", 0, timeout=30)
        pids.append(role.server_pid())
        assert role.earlier_server_gone() is True
    finally:
        sup.shutdown()
        for pid in pids:
            _reap(pid)


@pytest.mark.timeout(60)
def test_a_role_stopped_without_its_own_cleanup_leaves_no_server_in_its_own_group(run_dir):
    sup = Supervisor(run_dir, heartbeat_interval=0.2, heartbeat_timeout=30.0, shutdown_grace_s=0.5)
    pid = None
    try:
        role = sup.spawn("server", StartsAServer, str(run_dir / "server.pid"))
        pid = role.server_pid()
        os.kill(sup.pid("server"), signal.SIGSTOP)  # its SIGTERM handler (and on_stop) never runs
        sup.shutdown()  # _stop_children: the grace passes, the role's group is SIGKILLed ...
        assert _gone(pid)  # ... and its session ended
    finally:
        sup.shutdown()
        if pid is not None:
            _reap(pid)
