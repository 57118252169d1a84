"""A stopped rollout role shuts its backend down, bounded, and leaves nothing; a restarted
engine never races the old one's memory release (the fake GPU's ledger shows the order)."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from roles.rollout import EngineConfig, RolloutEngine
from runtime import Actor, Supervisor, endpoint
from runtime import supervisor as supervisor_module
from runtime.fakegpu import FakeDevice


def wait_for(pred, timeout=60.0):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _totals(device: FakeDevice, holder: str) -> list[int]:
    """The holder's bytes after each of its ledger changes."""
    held, out = {}, []
    for e in device.history():
        if e["kind"] == "usage" and e["holder"] == holder:
            held[e["tag"]] = e["nbytes"]
            out.append(sum(held.values()))
    return out


@pytest.mark.timeout(180)
def test_an_engine_releases_its_memory_before_its_restart_loads_and_when_it_is_stopped(run_dir, ckpt):
    sup = Supervisor(run_dir, heartbeat_interval=0.2, heartbeat_timeout=30.0, shutdown_grace_s=4.0,
                     fake_gpus=1, fake_gpu_bytes=1 << 30)
    device = FakeDevice(sup.fake_gpu_dir, 0)
    try:
        sup.leases.acquire(0, "rollout-0")  # an engine allocates as it starts
        engine = sup.spawn("rollout-0", RolloutEngine,
                           EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=2), gpus=[0])
        sup.wait_ready()
        loaded = device.usage("rollout-0")
        assert loaded > 0
        engine.kill()  # SIGKILL: no on_stop; the supervisor ends its session and drops its memory first
        assert wait_for(lambda: sup._children["rollout-0"].incarnation == 1
                        and sup._children["rollout-0"].state == "ready")
        totals = _totals(device, "rollout-0")
        first_peak = totals.index(loaded)
        assert 0 in totals[first_peak:], totals  # the old incarnation's bytes went to 0 ...
        assert totals[-1] == loaded  # ... before the new one loaded its own
        assert engine.generate([{"id": 0, "prompt_ids": [1], "sampling": {"max_new_tokens": 2}}])[0]["id"] == 0
        ends = len(device.history())
    finally:
        sup.shutdown()  # SIGTERM: the engine's on_stop frees its memory itself
    stopped = [e for e in device.history()[ends:] if e["kind"] == "usage" and e["holder"] == "rollout-0"]
    assert stopped and all(e["nbytes"] == 0 for e in stopped) and device.usage("rollout-0") == 0


class HangsOnStop(Actor):
    """A role that started a server process and whose shutdown never returns."""

    def __init__(self):
        # a group of its own: the supervisor's kill of the role's group misses it, so only the
        # role's own stop can end it
        self.server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)

    @endpoint
    def server_pid(self) -> int:
        return self.server.pid

    def on_stop(self) -> None:
        time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
def test_a_shutdown_that_hangs_is_cut_at_its_timeout_and_what_the_role_started_is_killed(run_dir, monkeypatch):
    # the supervisor's own end of the role's session (tests/test_runtime_sessions.py) would hide
    # a role that kills nothing: here only the role's stop may end the server
    monkeypatch.setattr(supervisor_module, "end_session", lambda *a, **k: None)
    sup = Supervisor(run_dir, heartbeat_interval=0.2, heartbeat_timeout=30.0, shutdown_grace_s=3.0)
    pid = None
    try:
        role = sup.spawn("server", HangsOnStop)
        pid = role.server_pid()
        process = sup._children["server"].process
    finally:
        sup.shutdown()
        server_gone = pid is not None and _gone(pid)
        if pid is not None and not server_gone:
            os.kill(pid, signal.SIGKILL)
    assert process.exitcode == 0  # it ended itself within the grace: the supervisor did not SIGKILL it
    assert server_gone
    errors = (run_dir / "errors").glob("server.*")
    assert any("HangsOnStop.on_stop did not return within 1.5 s" in p.read_text() for p in errors)
