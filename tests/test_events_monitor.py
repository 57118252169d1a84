import json
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from runtime.events import EventBus, follow_events, read_events, watch_socket
from runtime.monitor import MonitorState, render

REPO = Path(__file__).resolve().parents[1]


def _publish_ticks(run_dir, num_events, interval_s, finish):
    bus = EventBus(run_dir)
    for i in range(num_events):
        bus.publish("tick", i=i)
        time.sleep(interval_s)
    if finish == "close":
        bus.close("done")
    else:  # die without a shutdown event, as a killed supervisor does
        os._exit(1)


@pytest.fixture
def publisher():
    """Start _publish_ticks in a spawn process; reaped after the test."""
    processes = []

    def start(*args):
        process = mp.get_context("spawn").Process(target=_publish_ticks, args=args, daemon=True)
        process.start()
        processes.append(process)
        return process

    yield start
    for process in processes:
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()


def _wait_for_lines(path, count, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not reach {count} lines")


@pytest.mark.timeout(60)
def test_late_subscriber_gets_every_event_once_in_order(tmp_path, publisher):
    num_events = 300
    publisher(str(tmp_path), num_events, 0.002, "close")
    _wait_for_lines(tmp_path / "events.jsonl", 50)  # attach while it is mid-run
    events = list(follow_events(tmp_path, poll_s=0.05))
    assert [e["seq"] for e in events] == list(range(1, num_events + 2))
    assert [e["i"] for e in events[:-1]] == list(range(num_events))
    assert events[-1]["event"] == "shutdown" and events[-1]["reason"] == "done"


@pytest.mark.timeout(60)
def test_follow_ends_when_the_supervisor_dies_without_shutdown(tmp_path, publisher):
    process = publisher(str(tmp_path), 20, 0.005, "die")
    _wait_for_lines(tmp_path / "events.jsonl", 5)
    events = list(follow_events(tmp_path, poll_s=0.05))
    process.join(10)
    assert [e["i"] for e in events] == list(range(20))


@pytest.mark.timeout(60)
def test_follow_from_now_skips_the_history(tmp_path):
    bus = EventBus(tmp_path)
    bus.publish("old")
    follower = follow_events(tmp_path, from_start=False, poll_s=0.05)
    received = []
    thread = threading.Thread(target=lambda: received.extend(follower))
    thread.start()
    bus.publish("new")
    bus.close()
    thread.join(20)
    assert [e["event"] for e in received] == ["new", "shutdown"]


@pytest.mark.timeout(60)
def test_gaps_in_the_live_stream_are_filled_from_the_file(tmp_path):
    """A fake supervisor whose socket skips seq 2: the follower reads it from the log."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    (tmp_path / "supervisor.json").write_text(json.dumps(
        {"pid": os.getpid(), "started": time.time(), "events_endpoint": endpoint}))
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(endpoint)
    try:
        received = []
        # poll_s=10: within the 5 s below only the gap, not a quiet socket, can trigger a read.
        thread = threading.Thread(target=lambda: received.extend(follow_events(tmp_path, poll_s=10)),
                                  daemon=True)
        thread.start()
        time.sleep(0.5)  # connected and subscribed
        events = [{"event": "a", "seq": 1, "ts": 1.0}, {"event": "b", "seq": 2, "ts": 2.0},
                  {"event": "shutdown", "seq": 3, "ts": 3.0}]
        (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        for event in (events[0], events[2]):
            pub.send_multipart([event["event"].encode(), msgpack.packb(event)])
        thread.join(5)
        assert received == events
    finally:
        pub.close(linger=0)
        context.term()


def test_publish_returns_what_followers_see(tmp_path):
    with EventBus(tmp_path) as bus:
        record = bus.publish("metrics", step=np.int64(3), metrics={"loss": np.float32(0.5)},
                             gpus=(0, 1), residuals={0: 5})
        with pytest.raises(ValueError, match=r"\['seq'\] are reserved"):
            bus.publish("x", seq=1)
    assert record == {"event": "metrics", "seq": 1, "ts": record["ts"], "step": 3,
                      "metrics": {"loss": 0.5}, "gpus": [0, 1], "residuals": {"0": 5}}
    assert read_events(tmp_path)[0] == record
    info = json.loads((tmp_path / "supervisor.json").read_text())
    assert info["pid"] == os.getpid()
    assert info["events_endpoint"] == f"ipc://{tmp_path}/sockets/events.sock"
    assert os.stat(tmp_path / "sockets").st_mode & 0o777 == 0o700


def test_publish_is_thread_safe(tmp_path):
    with EventBus(tmp_path) as bus:
        threads = [threading.Thread(target=lambda n=n: [bus.publish("tick", thread=n) for _ in range(100)])
                   for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    events = read_events(tmp_path)
    assert [e["seq"] for e in events] == list(range(1, 402))
    assert sorted(e["thread"] for e in events[:-1]) == sorted(list(range(4)) * 100)


def test_a_run_dir_in_use_is_refused(tmp_path):
    with EventBus(tmp_path):
        with pytest.raises(RuntimeError, match=f"in use by the supervisor with pid {os.getpid()}"):
            EventBus(tmp_path)
    assert "ended" in json.loads((tmp_path / "supervisor.json").read_text())


def test_a_restarted_supervisor_keeps_the_previous_log(tmp_path):
    with EventBus(tmp_path) as bus:
        bus.publish("first_run")
    with EventBus(tmp_path) as bus:
        bus.publish("second_run")
    assert [e["event"] for e in read_events(tmp_path)] == ["second_run", "shutdown"]
    previous = (tmp_path / "events.1.jsonl").read_text().splitlines()
    assert [json.loads(line)["event"] for line in previous] == ["first_run", "shutdown"]


def test_a_run_dir_too_deep_for_an_ipc_socket_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="use a shorter run_dir"):
        EventBus(tmp_path / ("d" * 120))


@pytest.mark.timeout(60)
def test_following_never_writes_into_the_run_dir(tmp_path):
    with EventBus(tmp_path) as bus:
        bus.publish("a")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert [e["event"] for e in follow_events(tmp_path)] == ["a", "shutdown"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before


@pytest.mark.timeout(60)
def test_watch_socket_publishes_connection_events(tmp_path):
    bus = EventBus(tmp_path)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    watcher = watch_socket(router, bus, "control")
    router.bind(f"ipc://{tmp_path}/control.sock")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp_path}/control.sock")
    deadline = time.monotonic() + 10
    while not any(e["event"] == "socket" for e in read_events(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.01)
    dealer.close(linger=0)
    router.close(linger=0)
    watcher.join(10)
    bus.close()
    context.term()
    socket_events = [(e["socket"], e["what"]) for e in read_events(tmp_path) if e["event"] == "socket"]
    assert socket_events[0] == ("control", "accepted")
    assert ("control", "closed") in socket_events
    assert not watcher.is_alive()


def _monitor(*args):
    return subprocess.Popen([sys.executable, "-m", "runtime.monitor", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(60)
def test_monitor_json_follows_a_live_run_and_exits_0(tmp_path):
    bus = EventBus(tmp_path)
    monitor = _monitor(tmp_path, "--json")
    try:
        bus.publish("spawned", role="actor", incarnation=1, pid=123, gpus=[0])
        first = json.loads(monitor.stdout.readline())  # it is attached and printing
        assert first["event"] == "spawned" and first["role"] == "actor"
        bus.publish("metrics", step=1, metrics={"loss": 0.25})
        bus.close("done")
        out, err = monitor.communicate(timeout=30)
    finally:
        bus.close()
        if monitor.poll() is None:
            monitor.kill()
            monitor.communicate()
    assert monitor.returncode == 0, err
    rest = [json.loads(line) for line in out.splitlines()]
    assert [e["event"] for e in rest] == ["metrics", "shutdown"]
    assert [e["seq"] for e in [first, *rest]] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_monitor_table_attached_late_shows_the_run_and_exits_0(tmp_path):
    with EventBus(tmp_path) as bus:
        for event in SCRIPT:
            bus.publish(event["event"], **{k: v for k, v in event.items() if k not in ("event", "seq", "ts")})
    for args in ([], ["--once"]):
        monitor = _monitor(tmp_path, *args)
        out, err = monitor.communicate(timeout=30)
        assert monitor.returncode == 0, err
        assert "actor" in out and "rollout" in out and "step 2" in out


def test_following_a_dir_that_is_not_a_run_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no supervisor.json"):
        follow_events(tmp_path)


def test_monitor_without_supervisor_json_exits_2(tmp_path):
    monitor = _monitor(tmp_path, "--json")
    out, err = monitor.communicate(timeout=30)
    assert monitor.returncode == 2
    assert "has no supervisor.json" in err and out == ""


SCRIPT = [
    {"event": "supervisor_started", "pid": 100, "run_dir": "runs/x"},
    {"event": "spawned", "role": "actor", "incarnation": 1, "pid": 101, "gpus": [0]},
    {"event": "spawned", "role": "rollout", "incarnation": 1, "pid": 102, "gpus": [0]},
    {"event": "ready", "role": "actor", "incarnation": 1, "pid": 101, "gpus": [0]},
    {"event": "state", "role": "actor", "incarnation": 1, "pid": 101, "gpus": [0], "old": "ready", "new": "offloaded"},
    {"event": "lease", "gpu": 0, "holder": "actor", "action": "acquire", "bytes_left": None, "residuals": {}},
    {"event": "role_stats", "ts": 10.0, "roles": {"actor": {"rss_bytes": 1 << 30, "cpu": 50.0, "calls_total": 10, "errors_total": 0}}},
    {"event": "role_stats", "ts": 12.0, "roles": {"actor": {"rss_bytes": 2 << 30, "cpu": 90.0, "calls_total": 30, "errors_total": 1}}},
    {"event": "lease", "gpu": 0, "holder": "actor", "action": "release", "bytes_left": 512, "residuals": {"actor": 512}},
    {"event": "metrics", "step": 1, "metrics": {"loss": 1.0}},
    {"event": "died", "role": "rollout", "incarnation": 1, "pid": 102, "gpus": [0], "reason": "killed by SIGKILL",
     "error_file": None},
    {"event": "spawned", "role": "rollout", "incarnation": 2, "pid": 103, "gpus": [0]},
    {"event": "restarted", "role": "rollout", "incarnation": 2, "pid": 103, "gpus": [0], "reason": "killed by SIGKILL",
     "restarts": 1},
    {"event": "hung", "role": "actor", "incarnation": 1, "pid": 101, "silent_s": 31.0},
    {"event": "socket", "socket": "control", "what": "accepted", "endpoint": "ipc://x"},
    {"event": "rejected", "role": "supervisor", "reason": "bad token on control socket"},
    {"event": "metrics", "step": 2, "metrics": {"loss": 0.5, "kl": 0.01}},
]


def replayed(events: list[dict]) -> MonitorState:
    state = MonitorState()
    for seq, event in enumerate(events, start=1):
        state.apply({"seq": seq, "ts": float(seq), **event})
    return state


def rendered(state: MonitorState) -> str:
    from rich.console import Console
    console = Console(record=True, width=160)
    console.print(render(state, "runs/x"))
    return console.export_text()


def test_monitor_state_reduces_a_scripted_run():
    state = replayed(SCRIPT)
    actor, rollout = state.roles["actor"], state.roles["rollout"]
    assert (actor.incarnation, actor.pid, actor.gpus, actor.state) == (1, 101, [0], "hung")
    assert actor.rss_bytes == 2 << 30 and actor.errors_total == 1
    assert actor.calls_per_s == pytest.approx(10.0)  # 20 calls in 2 s of event time
    assert actor.last_error == "no heartbeat for 31 s"
    assert (rollout.incarnation, rollout.pid, rollout.state, rollout.restarts) == (2, 103, "starting", 1)
    assert rollout.last_error == "killed by SIGKILL"
    assert state.leases == {(0, 0, ""): {"holder": None, "residuals": {"actor": 512}}}
    assert (state.step, state.metrics) == (2, {"loss": 0.5, "kl": 0.01})
    assert state.num_rejected == 1 and state.last_rejected == "supervisor: bad token on control socket"
    assert state.last_seq == len(SCRIPT) and not state.ended and state.failure is None
    state.apply({"event": "failed", "seq": len(SCRIPT) + 1, "ts": 98.0, "reason": "too many restarts"})
    assert state.failure == "too many restarts"
    state.apply({"event": "shutdown", "seq": len(SCRIPT) + 2, "ts": 99.0, "reason": "done"})
    assert state.ended and state.shutdown_reason == "done"


def test_render_shows_roles_metrics_and_leases():
    text = rendered(replayed(SCRIPT))
    assert "2.0 GiB" in text and "10.0" in text and "killed by SIGKILL" in text
    assert "step 2: loss=0.5  kl=0.01" in text
    assert "gpu 0: lease free (actor keeps 512 B)" in text


PHASES = [
    {"event": "lease", "gpu": 0, "holder": "rollout-0", "action": "acquire", "bytes_left": None, "residuals": {}},
    {"event": "phase", "phase": "step", "action": "begin", "track": "driver", "step": 3},
    {"event": "phase", "phase": "rollout", "action": "begin", "track": "driver", "step": 3},
    {"event": "phase", "phase": "rollout", "action": "end", "track": "driver", "step": 3, "seconds": 1.5},
    {"event": "lease", "gpu": 0, "holder": "rollout-0", "action": "release", "bytes_left": 0, "residuals": {}},
    {"event": "lease", "gpu": 0, "holder": "actor", "action": "acquire", "bytes_left": None, "residuals": {}},
    {"event": "phase", "phase": "onload", "action": "span", "role": "actor", "t0": 4.5, "seconds": 0.25,
     "gpus": [0], "bytes": 3 << 20, "bytes_in_use": 3 << 20},
    {"event": "phase", "phase": "log_probs", "action": "begin", "track": "driver", "step": 3},
]


SIDE_BY_SIDE = [  # runtime.memory's events on a GPU split into budgets (ppo.gpu.side_by_side)
    {"event": "lease", "gpu": 0, "budget": "engine", "holder": "rollout-0", "action": "acquire", "bytes_left": None,
     "residuals": {}},
    {"event": "lease", "gpu": 0, "budget": "trainers", "holder": "critic", "action": "acquire", "bytes_left": None,
     "residuals": {}},
    {"event": "lease", "gpu": 0, "budget": "trainers", "holder": "critic", "action": "release", "bytes_left": 2048,
     "residuals": {"critic": 2048}},
    {"event": "lease", "gpu": 0, "budget": "trainers", "holder": "actor", "action": "acquire", "bytes_left": None,
     "residuals": {"critic": 2048}},
]


def test_monitor_shows_each_budgets_holder_on_a_side_by_side_gpu():
    """Two tenants hold one GPU at once: the engine's lease stays shown while the trainers'
    lease passes from the critic to the actor (one lease per GPU showed only the last event's)."""
    text = rendered(replayed(SIDE_BY_SIDE))
    assert "gpu 0: engine budget rollout-0, trainers budget actor (critic keeps 2.0 KiB); 2.0 KiB in use: critic 2.0 KiB" in text


def test_monitor_shows_the_running_phase_the_lease_holder_and_bytes_per_gpu():
    state = replayed(PHASES)
    assert [p["name"] for p in state.phases] == ["step", "log_probs"]
    assert state.gpu_bytes == {(0, 0): {"rollout-0": 0, "actor": 3 << 20}}
    state.apply({"seq": 50, "ts": 9.0, "event": "spawned", "role": "actor.1", "group": "actor", "incarnation": 0})
    state.apply({"seq": 51, "ts": 9.0, "event": "phase", "phase": "offload", "action": "span", "role": "actor.1",
                 "t0": 8.5, "seconds": 0.5, "gpus": [1], "bytes_in_use": 0})
    assert state.gpu_bytes[0, 1] == {"actor": 0}  # a rank's bytes count under its group, the lease holder
    text = rendered(state)
    assert "phase: step > log_probs (step 3)" in text
    assert "last finished: driver: rollout 1.50 s" in text  # role spans do not count: they are many
    assert "gpu 0: lease actor; 3.0 MiB in use: actor 3.0 MiB, rollout-0 0 B" in text
    state.apply({"seq": 99, "ts": 9.0, "event": "phase", "phase": "log_probs", "action": "end", "track": "driver",
                 "step": 3, "seconds": 2.0})
    assert [p["name"] for p in state.phases] == ["step"]
