"""Supervision: deaths, hangs, restarts, escalation, bad input, and no orphans."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import psutil
import pytest
import zmq

from runtime import Actor, ActorDied, Supervisor, SupervisionFailed, endpoint
from runtime.events import read_events
from tests.actors import Counter, DiesOnCall, Echo, FailsInInit

pytestmark = pytest.mark.timeout(60)


def wait_for(pred, timeout=10.0):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if pred():
            return True
        time.sleep(0.02)
    return False


def restarted(sup, name, incarnation):
    return wait_for(lambda: sup._children[name].incarnation >= incarnation
                    and sup._children[name].state == "ready")


@pytest.mark.parametrize("how", ["kill -9", "os._exit"])
def test_death_during_a_call_fails_every_pending_future_within_a_second_and_restarts(sup, how):
    c = sup.spawn("c", Counter)
    e = sup.spawn("e", Echo)
    assert c.incr() == 1
    if how == "kill -9":
        in_flight = e.sleep.call(30)
        time.sleep(0.2)
        e.kill()
        reason = "killed by SIGKILL"
    else:
        before = e.sleep.call(0.3)  # keeps the actor busy so the next two calls are queued
        in_flight = e.exit_now.call(3)
        reason = "exited with code 3"
    queued = e.ping.call("never")
    if how == "os._exit":
        # os._exit may beat zmq's I/O thread to sending the previous reply: either outcome is fine
        assert isinstance(before.exception(timeout=10), (type(None), ActorDied))
    t0 = time.monotonic()
    for fut in (in_flight, queued):
        with pytest.raises(ActorDied, match=reason):
            fut.result(timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert restarted(sup, "e", 1)
    assert e.ping("back") == "back" and e.incarnation == 1
    assert c.incr() == 2  # one_for_one: the other actor kept its state


def test_sigstop_during_a_call_is_declared_hung_and_restarted(sup, run_dir):
    e = sup.spawn("e", Echo)
    e.ping(1)
    slow = e.sleep.call(30)
    os.kill(sup.pid("e"), signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(ActorDied, match="hung: no heartbeat"):
        slow.result(timeout=10)
    assert time.monotonic() - t0 < sup.heartbeat_timeout + 1.0
    assert restarted(sup, "e", 1)
    assert e.ping(2) == 2
    assert any(ev["event"] == "hung" and ev["role"] == "e" for ev in read_events(run_dir))


def test_restarted_actor_still_stops_cleanly_at_shutdown(run_dir):
    """Restarts are forked by the same long-lived thread as first starts: a death signal tied
    to a short-lived thread would SIGKILL the new incarnation instead of a clean SIGTERM exit."""
    sup = Supervisor(run_dir, heartbeat_interval=0.1, shutdown_grace_s=5)
    e = sup.spawn("e", Echo)
    e.ping(1)
    e.kill()
    assert restarted(sup, "e", 1)
    proc = sup._children["e"].process
    sup.shutdown()
    assert proc.exitcode == 0
    assert not (run_dir / "errors" / "e.1.txt").exists()


def test_reply_from_a_dead_incarnation_is_dropped(sup):
    e = sup.spawn("e", Echo)
    e.ping(1)
    fut = e.sleep.call(0.3)
    e.kill()
    with pytest.raises(ActorDied):
        fut.result(timeout=5)
    assert restarted(sup, "e", 1)
    assert e.ping("new") == "new"


def test_restart_intensity_escalates_with_the_error_file(run_dir):
    sup = Supervisor(run_dir, heartbeat_interval=0.1, max_restarts=2, restart_window_s=30)
    try:
        d = sup.spawn("d", DiesOnCall)
        other = sup.spawn("other", Echo)
        other.ping(1)
        for i in range(3):
            assert wait_for(lambda: sup._children["d"].state == "ready" or sup._failure is not None)
            with pytest.raises((ActorDied, SupervisionFailed)):
                d.crash()
        assert wait_for(lambda: sup._failure is not None)
        with pytest.raises(SupervisionFailed, match="restart intensity exceeded: 3 restarts"):
            sup.check()
        with pytest.raises((ActorDied, SupervisionFailed)):
            other.ping(1)  # everything was stopped
        assert not psutil.pid_exists(sup.pid("other")) or psutil.Process(sup.pid("other")).status() == "zombie"
    finally:
        sup.shutdown()
    assert any(ev["event"] == "failed" for ev in read_events(run_dir))


def test_death_while_starting_fails_fast_with_the_traceback(run_dir):
    sup = Supervisor(run_dir, heartbeat_interval=0.1)
    try:
        f = sup.spawn("f", FailsInInit)
        with pytest.raises((ActorDied, SupervisionFailed), match="bad checkpoint path"):
            f.ping()
        with pytest.raises(SupervisionFailed, match="died while starting") as info:
            sup.wait_ready(timeout=10)
        assert "RuntimeError: bad checkpoint path: /nonexistent" in str(info.value)
        assert "errors/f.0.txt" in str(info.value)
    finally:
        sup.shutdown()


def test_one_for_all_restarts_the_whole_group(sup):
    a = sup.spawn("a", Counter, restart="one_for_all", group="gpu0")
    b = sup.spawn("b", Counter, restart="one_for_all", group="gpu0")
    solo = sup.spawn("solo", Counter)
    assert (a.incr(), b.incr(), b.incr(), solo.incr()) == (1, 1, 2, 1)
    a.kill()
    assert restarted(sup, "a", 1) and restarted(sup, "b", 1)
    assert b.incr() == 1 and a.incr() == 1  # fresh state in both
    assert solo.incr() == 2 and solo.incarnation == 0


def test_restart_counts_count_each_death_once_whether_or_not_a_caller_saw_it(sup):
    """A role killed while idle comes back before anyone calls it (no caller sees ActorDied);
    one killed with two calls pending fails both futures. Each is one restart, counted at
    the death; a one_for_all group restarted for one death counts one restart too."""
    e = sup.spawn("e", Echo)
    a = sup.spawn("a", Counter, restart="one_for_all", group="g")
    sup.spawn("b", Counter, restart="one_for_all", group="g")
    t = sup.spawn("t", Echo, restart="temporary")
    e.ping(0)
    e.kill()  # idle
    assert restarted(sup, "e", 1)
    assert e.ping(1) == 1
    first, second = e.sleep.call(30), e.sleep.call(30)
    e.kill()
    for fut in (first, second):
        with pytest.raises(ActorDied):
            fut.result(timeout=5)
    assert restarted(sup, "e", 2)
    a.kill()
    assert restarted(sup, "a", 1) and restarted(sup, "b", 1)
    t.kill()
    assert wait_for(lambda: sup._children["t"].state == "dead")
    assert sup.restart_counts() == {"e": 2, "a": 1}  # b restarted with a's death; t never restarts


def test_temporary_actor_is_not_restarted(sup):
    t = sup.spawn("t", Echo, restart="temporary")
    t.ping(1)
    t.kill()
    assert wait_for(lambda: sup._children["t"].state == "dead")
    time.sleep(0.3)
    with pytest.raises(ActorDied):
        t.ping(1)
    sup.check()  # a temporary death is not a failure


def _raw_dealer(sup, name):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(sup.directory.resolve(name).endpoint)
    return s


def test_garbage_frames_and_wrong_tokens_are_dropped_counted_and_reported(sup, run_dir):
    e = sup.spawn("e", Echo)
    e.ping(1)
    raw = _raw_dealer(sup, "e")
    forged = {"kind": "call", "id": 1, "src": "evil", "dst": "e", "method": "exit_now", "inc": 0,
              "deadline": None, "token": "not-the-token", "bufs": [],
              "body": msgpack.packb([[0], {}])}
    raw.send_multipart([msgpack.packb(forged)])
    raw.send_multipart([b"\x00\xffgarbage", b"more"])
    raw.send_multipart([msgpack.packb({"kind": "call"})])
    assert wait_for(lambda: len([ev for ev in read_events(run_dir) if ev["event"] == "rejected"]) >= 3)
    raw.close()
    assert e.ping("still here") == "still here"
    reasons = [ev["reason"] for ev in read_events(run_dir) if ev["event"] == "rejected"]
    assert any("bad token" in r for r in reasons) and any("not msgpack" in r for r in reasons)
    assert wait_for(lambda: sup._children["e"].stats.get("rejected") == 3)


def test_oversized_message_is_rejected_and_the_actor_keeps_serving(run_dir):
    import numpy as np
    with Supervisor(run_dir, heartbeat_interval=0.1, max_message_bytes=1 << 20) as sup:
        e = sup.spawn("e", Echo)
        e.ping(1)
        raw = _raw_dealer(sup, "e")
        hdr = {"kind": "call", "id": 1, "src": "x", "dst": "e", "method": "ping", "inc": 0,
               "deadline": None, "token": sup.cfg.token, "bufs": [], "body": msgpack.packb([[], {}])}
        raw.send_multipart([msgpack.packb(hdr)] + [b"x" * (600 << 10)] * 2)  # 1.2 MiB in two frames
        raw.send_multipart([msgpack.packb(hdr), b"x" * (2 << 20)])            # one 2 MiB frame
        assert wait_for(lambda: any("exceeds max_message_bytes" in ev.get("reason", "")
                                    for ev in read_events(run_dir)))
        raw.close()
        assert e.ping(np.ones(2)).tolist() == [1, 1]


SUPERVISOR_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from runtime import Supervisor
    from tests.actors import Echo
    sup = Supervisor({run_dir!r}, heartbeat_interval=0.1)
    a, b = sup.spawn("a", Echo), sup.spawn("b", Echo)
    print(a.pid(), b.pid(), a.spawn_grandchild(), flush=True)
    time.sleep(60)
""")


def test_supervisor_killed_leaves_no_orphans(run_dir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT.format(root=root, run_dir=str(run_dir))],
                            stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    proc.kill()
    proc.wait()
    gone = lambda p: not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
    assert wait_for(lambda: all(gone(p) for p in pids), timeout=5), "roles or their children survived"


def test_sigusr1_to_a_role_whose_supervisor_lives_is_ignored(sup):
    """Slurm's --signal=USR1@T and `scancel --signal=USR1` reach every process of the step; SIGUSR1
    is also the roles' death signal (PR_SET_PDEATHSIG), which must act only when the supervisor
    is gone (found under a real Slurm: every role took its process group down)."""
    echo = sup.spawn("echo", Echo)
    pid = echo.pid()
    os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5)
    assert echo.pid() == pid and echo.ping(2) == 2 and sup.restart_counts() == {}


def test_shutdown_sigterms_then_sigkills_and_cleans_shared_memory(run_dir):
    import numpy as np
    sup = Supervisor(run_dir, heartbeat_interval=0.1, shutdown_grace_s=0.5)
    e = sup.spawn("e", Echo)
    e.ping(np.ones(1 << 20))  # leaves pooled shared-memory segments behind
    grand = e.spawn_grandchild()
    t0 = time.monotonic()
    sup.shutdown()
    assert time.monotonic() - t0 < 5
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(sup.cfg.shm_prefix)]
    assert wait_for(lambda: not psutil.pid_exists(grand) or psutil.Process(grand).status() == "zombie")


class LoadsOnItsGpu(Actor):
    """Allocates on its fake GPU while starting, as a rollout engine loads its weights; a
    class of this module so that role processes can import it."""

    def __init__(self, nbytes: int):
        from runtime.fakegpu import visible_fake_devices

        self.devices = visible_fake_devices()
        self.nbytes = nbytes
        self.take()

    @endpoint
    def take(self):
        for d in self.devices:
            d.set_usage(self.context.name, "weights", self.nbytes)

    @endpoint
    def free(self):
        for d in self.devices:
            d.set_usage(self.context.name, "weights", 0)


def test_a_role_dead_while_another_holds_its_gpu_restarts_when_it_holds_the_lease_again(run_dir):
    """Without the deferral the restart fails to allocate (the trainer holds the lease), each
    failure counts toward the restart intensity, and the supervisor gives up."""
    sup = Supervisor(run_dir, heartbeat_interval=0.1, heartbeat_timeout=2.0, shutdown_grace_s=2.0,
                     fake_gpus=1, fake_gpu_bytes=1 << 30, max_restarts=2)
    try:
        sup.leases.acquire(0, "engine")
        engine = sup.spawn("engine", LoadsOnItsGpu, 1000, gpus=[0])
        other = sup.spawn("other", Echo)  # no GPU: restarts at once as before
        sup.wait_ready()
        engine.free()
        sup.leases.release(0, "engine", 0)
        sup.leases.acquire(0, "trainer")
        engine.kill()
        assert wait_for(lambda: any(e["event"] == "restart_deferred" for e in read_events(run_dir)))
        time.sleep(1.0)
        sup.check()  # not given up
        assert sup._children["engine"].incarnation == 0 and sup._children["engine"].state == "dead"
        other.kill()
        assert restarted(sup, "other", 1)  # restarts at once, as before
        sup.leases.release(0, "trainer", 0)
        sup.leases.acquire(0, "engine")
        engine.take()  # queued until the new incarnation is ready; it holds the lease, so it may grow
        assert restarted(sup, "engine", 1)
        sup.check()  # 2 restarts in all (other's, and the engine's when it took its GPU): none failed
        assert sup._children["engine"].restarts == 1
        deferred = next(e for e in read_events(run_dir) if e["event"] == "restart_deferred")
        assert deferred["waiting_for"] == {"0": "trainer"} and deferred["reason"] == "killed by SIGKILL"
    finally:
        sup.shutdown()
