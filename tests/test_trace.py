"""One short tiny_ppo run through launch.py with its stdout on a pipe, then what an operator
reads from it: the plain lines, RUN_DIR/trace.json, the plot and the monitor. Plus the trace
builder on scripted events (restarts, a crash without a closing bracket)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from ppo.plot import main as plot_main
from ppo.observe.metrics_file import read_metrics
from ppo.plot import step_phases
from ppo.config.recipes import tiny_ppo
from ppo.observe.trace import TraceBuilder, TraceWriter, build_trace, read_trace
from runtime.events import EventBus, read_events

REPO = Path(__file__).resolve().parents[1]
NUM_ROLLOUT = 3  # step 0 is the critic-only warm-up (tiny_ppo): 2 actor updates and weight syncs


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("piped") / "run"
    proc = subprocess.run([sys.executable, "launch.py", "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "16",
                           "--run-dir", str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc.stdout


def tracks(trace: list[dict]) -> tuple[dict, dict]:
    """({pid: track name}, {(pid, tid): thread name}); a trainer's ranks ("actor.1") count as the role."""
    procs = {e["pid"]: e["args"]["name"].split(".")[0] for e in trace
             if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


@pytest.mark.timeout(420)
def test_piped_output_is_one_plain_line_per_rollout(piped_run):
    _, out = piped_run
    lines = out.splitlines()
    rollouts = [line for line in lines if line.startswith("[ppo] step=")]
    assert [line.split()[1] for line in rollouts] == [f"step={i}/{NUM_ROLLOUT}" for i in range(1, NUM_ROLLOUT + 1)]
    for line in rollouts:
        fields = dict(kv.split("=", 1) for kv in line.split()[1:])
        assert set(fields) == {"step", "reward", "response_len", "step_time", "elapsed", "eta"}
        assert 0 <= float(fields["reward"]) <= 1 and float(fields["response_len"]) > 0
        assert float(fields["step_time"].rstrip("s")) > 0 and float(fields["eta"].rstrip("s")) >= 0
    for stage in ("building the tiny model", "loading the tokenizer and data", "spawning the roles",
                  "waiting for the roles to load their weights"):
        assert any(line.startswith(f"[startup] {stage}") and ": done in " in line for line in lines), stage
    spawned = {e["role"] for e in read_events(piped_run[0]) if e["event"] == "spawned"}
    assert len(spawned) >= 5  # reward, 2 engines, actor and critic (or their ranks)
    assert {line.split()[1] for line in lines if line.endswith("s after spawn")} == spawned
    assert "\x1b[" not in out  # no progress bar escapes on a pipe


@pytest.mark.timeout(420)
def test_trace_has_a_track_per_role_and_gpu_with_phases_bytes_buckets_and_leases(piped_run):
    run_dir, _ = piped_run
    trace = json.loads((run_dir / "trace.json").read_text())  # closed: plain JSON
    procs, threads = tracks(trace)
    assert set(procs.values()) == {"driver", "reward-0", "rollout-0", "rollout-1", "actor", "critic", "gpu 0", "gpu 1"}
    by_track = lambda proc, ph: Counter(e.get("name") for e in trace if e["ph"] == ph and procs.get(e["pid"]) == proc)
    driver = by_track("driver", "B")
    assert {f"step {i}" for i in range(NUM_ROLLOUT)} <= set(driver)
    for phase, n in (("rollout", 3), ("log_probs", 3), ("values", 3), ("advantages", 3), ("critic_train", 3),
                     ("actor_train", 2), ("weight_sync", 2)):
        assert driver[phase] == n, (phase, driver)
    # every span that began ended (the run closed), thread by thread
    begins = Counter((e["pid"], e["tid"]) for e in trace if e["ph"] == "B")
    assert begins == Counter((e["pid"], e["tid"]) for e in trace if e["ph"] == "E")
    spans = [e for e in trace if e["ph"] == "X"]
    for role, names in (("actor", {"onload", "offload", "weight_bucket"}), ("critic", {"onload", "offload"}),
                        ("rollout-0", {"release", "resume"})):
        assert names <= {e["name"] for e in spans if procs[e["pid"]] == role}, role
    moved = [e for e in spans if procs[e["pid"]] == "actor" and e["name"] == "onload"]
    assert max(e["args"]["bytes"] for e in moved) > 0 and all(e["dur"] >= 0 for e in moved)
    buckets = [e for e in spans if e["name"] == "weight_bucket"]
    assert len(buckets) >= 2 and all(e["args"]["bytes"] > 0 for e in buckets)
    assert not any(e["args"]["direct"] for e in buckets)  # CPU weights: packed (direct needs CUDA IPC)
    for gpu in (0, 1):
        holders = by_track(f"gpu {gpu}", "B")
        assert {"actor", "critic", f"rollout-{gpu}"} <= set(holders)  # the handoffs, one span per lease
        counters = [e for e in trace if e["ph"] == "C" and procs[e["pid"]] == f"gpu {gpu}"]
        assert counters and max(sum(e["args"].values()) for e in counters) > 0
        assert set(counters[-1]["args"]) == {"actor", "critic", f"rollout-{gpu}"}  # by lease holder (a rank counts as its group)
    states = by_track("rollout-0", "B")
    # tiny_ppo evaluates before step 0: one generate call per eval set (ppo.generate.evaluation)
    num_eval_calls = len(tiny_ppo().evaluation.eval_prompt_data) // 2
    assert states["generating"] == NUM_ROLLOUT + num_eval_calls and states["starting"] == 1
    assert by_track("reward-0", "B")["scoring"] >= NUM_ROLLOUT


@pytest.mark.timeout(420)
def test_trace_rebuilt_from_the_event_log_matches_the_live_one(piped_run, tmp_path):
    run_dir, _ = piped_run
    live = json.loads((run_dir / "trace.json").read_text())
    rebuilt_dir = tmp_path / "copy"
    rebuilt_dir.mkdir()
    (rebuilt_dir / "events.jsonl").write_text((run_dir / "events.jsonl").read_text())
    rebuilt = read_trace(build_trace(rebuilt_dir))
    assert len(rebuilt) == len(live)
    assert Counter(e.get("name") for e in rebuilt) == Counter(e.get("name") for e in live)


@pytest.mark.timeout(420)
def test_plot_adds_a_stacked_bar_of_step_time_by_phase(piped_run, tmp_path, capsys):
    run_dir, _ = piped_run
    rows = [r for r in read_metrics(run_dir) if "perf/step_time" in r]  # the rollouts' lines, not eval's
    phases, steps, seconds = step_phases(rows)
    assert steps == list(range(NUM_ROLLOUT))
    assert {"rollout", "log_probs", "values", "critic_train", "train", "weight_sync", "offload", "other"} <= set(phases)
    for i, row in enumerate(rows):  # the bars stack up to the step time
        assert sum(col[i] for col in seconds) == pytest.approx(row["perf/step_time"], rel=1e-6)
        assert all(col[i] >= 0 for col in seconds)
    out = tmp_path / "curves.png"
    assert plot_main([str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


@pytest.mark.timeout(420)
def test_monitor_of_the_finished_run_shows_leases_and_bytes_per_gpu(piped_run):
    run_dir, _ = piped_run
    proc = subprocess.run([sys.executable, "-m", "runtime.monitor", str(run_dir), "--once"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for gpu in (0, 1):
        line = next(line for line in proc.stdout.splitlines() if f"gpu {gpu}: lease" in line)
        assert f"rollout-{gpu}" in line and " in use: " in line and "actor 0 B" in line
    assert "last finished: driver: step" in proc.stdout


def test_trace_builder_marks_deaths_and_restarts_and_ends_open_spans():
    builder, trace = TraceBuilder(), []
    for e in [{"event": "spawned", "role": "rollout-0", "incarnation": 0, "ts": 1.0},
              {"event": "state", "role": "rollout-0", "old": "starting", "new": "generating", "ts": 2.0},
              {"event": "died", "role": "rollout-0", "incarnation": 0, "reason": "SIGKILL", "ts": 2.5},
              {"event": "restarted", "role": "rollout-0", "incarnation": 1, "restarts": 1, "ts": 2.6},
              {"event": "spawned", "role": "rollout-0", "incarnation": 1, "ts": 2.6},
              {"event": "phase", "phase": "rollout", "action": "begin", "track": "driver", "step": 0, "ts": 1.5}]:
        e["seq"] = len(trace)
        trace += builder.add(e)
    trace += builder.finish(3.0)
    names = [e.get("name") for e in trace if e["ph"] == "i"]
    assert names == ["spawned #0", "died", "restarted #1", "spawned #1"]
    died = next(e for e in trace if e.get("name") == "died")
    assert died["args"]["reason"] == "SIGKILL" and died["ts"] == 1.5e6  # microseconds from the first event
    begins = Counter((e["pid"], e["tid"]) for e in trace if e["ph"] == "B")
    assert begins == Counter((e["pid"], e["tid"]) for e in trace if e["ph"] == "E")


def test_a_side_by_side_gpus_budgets_each_have_a_lease_track():
    """The engine holds its budget's lease while the trainers' passes from critic to actor: the
    critic's release ends the critic's span, not the engine's (one track per GPU ended it)."""
    builder, trace = TraceBuilder(), []
    lease = dict(event="lease", gpu=0, residuals={}, bytes_left=None)
    for e in [dict(lease, budget="engine", holder="rollout-0", action="acquire", ts=1.0),
              dict(lease, budget="trainers", holder="critic", action="acquire", ts=2.0),
              dict(lease, budget="trainers", holder="critic", action="release", bytes_left=0, ts=3.0),
              dict(lease, budget="trainers", holder="actor", action="acquire", ts=4.0)]:
        e["seq"] = len(trace)
        trace += builder.add(e)
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    spans = [(tracks[e["tid"]], e["ph"], e.get("name")) for e in trace if e["ph"] in "BE"]
    assert spans == [("lease: engine budget", "B", "rollout-0"), ("lease: trainers budget", "B", "critic"),
                     ("lease: trainers budget", "E", None), ("lease: trainers budget", "B", "actor")]


@pytest.mark.timeout(60)
def test_a_trace_is_readable_while_the_run_goes_and_after_a_crash(tmp_path):
    bus = EventBus(tmp_path)
    writer = TraceWriter(tmp_path, poll_s=0.05)
    try:
        bus.publish("phase", phase="rollout", action="begin", track="driver", step=0)
        bus.publish("lease", gpu=0, holder="actor", action="acquire", bytes_left=None, residuals={})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = (tmp_path / "trace.json").read_text()
            if '"actor"' in text:
                break
            time.sleep(0.05)
        assert not text.rstrip().endswith("]")  # still open, as a crash would leave it
        partial = read_trace(tmp_path / "trace.json")  # the format's missing `]` is tolerated
        assert {"rollout", "actor"} <= {e.get("name") for e in partial}
    finally:
        bus.close()
        writer.close()
    closed = json.loads((tmp_path / "trace.json").read_text())
    assert closed[-1]["name"] == "shutdown"
