"""ppo.observe.console: what a run prints in each mode (the piped end-to-end run is in test_trace.py)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo.config.cli import parse_args
from ppo.config import ConfigError
from ppo.config.serialize import override
from ppo.observe.console import RunConsole, ready_seconds
from ppo.observe.logger import RunLogger
from ppo.config.recipes import tiny_ppo

REPO = Path(__file__).resolve().parents[1]
METRICS = {"rollout/raw_reward": 0.25, "rollout/response_len": 2.0, "perf/step_time": 1.5}


def drive(mode: str, tmp_path: Path, **kw) -> tuple[str, list[tuple]]:
    """Two rollouts through the real RunLogger; returns the console's output and the events."""
    out, events = io.StringIO(), []
    console = RunConsole(mode, out=out, **kw)
    console.begin("building the tiny model")
    console.begin("waiting for the roles to load their weights")
    console.roles_ready({"actor": 1.25, "rollout-0": 2.5})
    log = RunLogger(tmp_path, num_rollout=4, publish=lambda e, **f: events.append((e, f)), console=console,
                    dump_samples=False)
    for step in (0, 1):
        perf = log.step_phases(step)
        with perf.phase("rollout"):
            pass
        log.log(step, {**METRICS, **perf, "perf/step_time": 1.5})
    log.close()
    return out.getvalue(), events


def test_plain_prints_startup_stages_with_times_and_one_line_per_rollout(tmp_path):
    text, _ = drive("plain", tmp_path)
    lines = text.splitlines()
    assert "[startup] building the tiny model ..." in lines
    assert any(line.startswith("[startup] building the tiny model: done in ") for line in lines)
    assert "[startup] rollout-0 ready 2.50 s after spawn" in lines
    steps = [line for line in lines if line.startswith("[ppo] ")]
    assert [s.split()[1] for s in steps] == ["step=1/4", "step=2/4"]
    fields = dict(kv.split("=") for kv in steps[1].split()[1:])
    assert fields["reward"] == "0.2500" and fields["response_len"] == "2.00" and fields["step_time"] == "1.50s"
    assert fields["eta"].endswith("s") and float(fields["eta"][:-1]) >= 0
    assert any(line.startswith("[summary] rollout/raw_reward first=0.25") for line in lines)
    assert "\x1b[" not in text  # no terminal escapes in a file


def test_json_is_one_object_per_line(tmp_path):
    text, _ = drive("json", tmp_path)
    records = [json.loads(line) for line in text.splitlines()]  # every line parses
    types = [r["type"] for r in records]
    assert types == ["startup", "startup", "rollout", "rollout", "done"]
    assert records[1]["roles"] == {"actor": 1.25, "rollout-0": 2.5}
    assert records[3]["step"] == 1 and records[3]["metrics"]["rollout/raw_reward"] == 0.25
    assert records[3]["metrics"]["perf/rollout_time"] >= 0 and records[3]["eta_s"] >= 0
    assert records[4]["rollouts"] == 2


def test_quiet_prints_nothing(tmp_path):
    text, events = drive("quiet", tmp_path)
    assert text == ""
    assert [e for e, _ in events].count("metrics") == 2  # the numbers still go to the bus and files
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_rich_shows_the_bar_and_the_summary_table(tmp_path):
    text, _ = drive("rich", tmp_path)
    assert "PPO" in text and "2/4" in text and "PPO summary: 2 rollouts" in text


def test_phases_are_published_as_spans_and_timed(tmp_path):
    _, events = drive("quiet", tmp_path)
    phases = [(f["phase"], f["action"], f["step"]) for e, f in events if e == "phase"]
    assert phases[:4] == [("step", "begin", 0), ("rollout", "begin", 0), ("rollout", "end", 0), ("step", "end", 0)]


def test_a_long_step_prints_a_progress_line_every_interval(tmp_path):
    out = io.StringIO()
    console = RunConsole("plain", out=out, log_interval_s=0.2)
    console.start_training(num_rollout=3, start_step=0)
    console.phase(0, "rollout")
    time.sleep(0.9)
    console.close([])
    lines = [line for line in out.getvalue().splitlines() if "running phase=rollout" in line]
    assert 2 <= len(lines) <= 5, out.getvalue()
    assert lines[0].startswith("[ppo] step=1/3 running phase=rollout for ")


def test_auto_is_rich_on_a_terminal_and_plain_otherwise(monkeypatch):
    cfg = tiny_ppo()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert RunConsole.for_config(cfg).mode == "plain"
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert RunConsole.for_config(cfg).mode == "rich"
    assert RunConsole.for_config(override(cfg, quiet=True)).mode == "quiet"
    assert RunConsole.for_config(override(cfg, log_format="json")).mode == "json"


def test_flags_are_validated():
    assert parse_args(["--log-format", "json"]).logging.log_format == "json"
    with pytest.raises(ConfigError) as err:
        parse_args(["--log-format", "xml", "--log-interval-s", "0"])
    assert "--log-format 'xml'" in str(err.value) and "one of: auto, rich, plain, json" in str(err.value)
    assert "log_interval_s" in str(err.value)
    with pytest.raises(ConfigError, match="--quiet is set and so is --log-format json"):
        parse_args(["--quiet", "--log-format", "json"])


def test_ready_seconds_reads_spawn_to_ready_from_events():
    events = [{"event": "spawned", "role": "a", "ts": 1.0}, {"event": "spawned", "role": "b", "ts": 1.5},
              {"event": "ready", "role": "a", "ts": 3.0}, {"event": "ready", "role": "b", "ts": 2.0}]
    assert ready_seconds(events) == {"a": 2.0, "b": 0.5}


@pytest.mark.timeout(120)
def test_quiet_run_prints_only_the_error(tmp_path):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text("this is not json\n")
    proc = subprocess.run([sys.executable, "launch.py", "--quiet", "--prompt-data", str(bad), "--no-skip-bad-samples",
                           "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("tandem: ") and "prompts.jsonl" in proc.stderr


def test_an_eval_prints_one_line_per_set_and_a_json_record():
    import io

    from ppo.observe.console import RunConsole
    metrics = {"eval/aime-2024": 0.25, "eval/aime-2024-pass@1": 0.25, "eval/aime-2024-pass@2": 0.4,
               "eval/aime-2024-pass@4": 0.5, "eval/aime-2024/response_len/mean": 7.0,
               "eval/aime-2024-truncated_ratio": 0.125, "eval/sums": 1.0, "eval/sums-pass@1": 1.0,
               "eval/sums/response_len/mean": 2.0, "eval/sums-truncated_ratio": 0.0, "eval/weight_version": 3.0}
    out = io.StringIO()
    RunConsole("plain", out=out).eval(4, metrics)
    assert out.getvalue().splitlines() == [
        "[eval] step=4 aime-2024 reward=0.2500 pass@1=0.250 pass@4=0.500 response_len=7.00 truncated=0.125",
        "[eval] step=4 sums reward=1.0000 pass@1=1.000 response_len=2.00 truncated=0.000"]
    out = io.StringIO()
    RunConsole("json", out=out).eval(4, metrics)
    assert json.loads(out.getvalue()) == {"type": "eval", "step": 4, "metrics": metrics}


def test_summary_says_what_it_averages_and_never_compares_a_rollout_with_itself():
    from ppo.observe.console import rollouts, summary_rows, summary_windows

    history = [{"step": s, "rollout/raw_reward": float(s)} for s in range(3, 15)]  # a run resumed at step 3
    first, last = summary_windows(history)
    assert (rollouts(first), rollouts(last)) == ("rollouts 3-7", "rollouts 10-14")
    assert summary_rows(history) == [("rollout/raw_reward", 5.0, 12.0)]
    short = history[:4]  # shorter than 2 x 5: halves, none in both
    assert [rollouts(w) for w in summary_windows(short)] == ["rollouts 3-4", "rollouts 5-6"]
    assert [rollouts(w) for w in summary_windows(history[:3])] == ["rollout 3", "rollout 5"]  # the middle left out
    assert summary_windows(history[:1]) == ([], []) and summary_rows(history[:1]) == []


def test_plain_summary_lines_name_the_rollouts_they_average(tmp_path):
    text, _ = drive("plain", tmp_path)
    assert "[summary] rollout/raw_reward first=0.25 last=0.25 (means of rollout 0 and of rollout 1)" in text.splitlines()
