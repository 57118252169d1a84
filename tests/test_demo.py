"""runtime.demo runs a live job that a monitor attached late follows to its end."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.events import EVENTS_FILE, read_events
from runtime.fakegpu import FakeDevice, check_no_overlap

REPO = Path(__file__).resolve().parents[1]


def _wait_for_event(run_dir: Path, name: str, demo: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / EVENTS_FILE).exists() and any(e["event"] == name for e in read_events(run_dir)):
            return
        assert demo.poll() is None, f"the demo ended (rc {demo.returncode}) before a {name!r} event"
        time.sleep(0.1)
    raise AssertionError(f"no {name!r} event within {timeout} s")


@pytest.mark.timeout(120)
def test_demo_is_followed_by_a_late_monitor_to_a_clean_end(tmp_path):
    run_dir = tmp_path / "demo"
    demo = subprocess.Popen([sys.executable, "-m", "runtime.demo", "--run-dir", str(run_dir), "--seconds", "5"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    monitor = None
    try:
        # attach late: after the scorer's crash and restart, so those come from the replayed log
        _wait_for_event(run_dir, "restarted", demo, timeout=60)
        monitor = subprocess.Popen([sys.executable, "-m", "runtime.monitor", str(run_dir), "--json"],
                                   cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        demo_out, demo_err = demo.communicate(timeout=60)
        monitor_out, monitor_err = monitor.communicate(timeout=30)
    finally:
        for proc in (demo, monitor):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    assert demo.returncode == 0, demo_err
    assert f"run dir: {run_dir}" in demo_out
    assert f"python -m runtime.monitor {run_dir}" in demo_out
    assert monitor.returncode == 0, monitor_err

    events = [json.loads(line) for line in monitor_out.splitlines()]
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # the whole run, each once
    assert events[-1]["event"] == "shutdown"
    kinds = {e["event"] for e in events}
    assert {"spawned", "ready", "metrics", "restarted", "lease"} <= kinds
    assert [(e["role"], e["incarnation"]) for e in events if e["event"] == "restarted"] == [("scorer", 1)]
    crash = next(e for e in events if e["event"] == "died" and e["role"] == "scorer")
    assert "SimulatedCrash" in Path(crash["error_file"]).read_text()
    metrics = [e for e in events if e["event"] == "metrics"]
    assert [e["step"] for e in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) >= 3
    assert all(0 <= e["metrics"]["rollout/raw_reward"] <= 1 for e in metrics)
    holders = {e["holder"] for e in events if e["event"] == "lease" and e["action"] == "acquire"}
    assert holders == {"engine0", "engine1", "trainer"}

    for gpu in (0, 1):  # the fake GPUs' ledger: nobody grew memory without holding the lease
        history = FakeDevice(run_dir / "fakegpu", gpu).history()
        assert {h["holder"] for h in history if h["kind"] == "usage"} == {f"engine{gpu}", "trainer"}
        assert check_no_overlap(history) == []
