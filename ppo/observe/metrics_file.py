"""RUN_DIR/metrics.jsonl: one JSON record per rollout (and per eval), as ppo.observe.logger writes
it; read back by ppo.plot and the logger, trimmed when a run goes back to a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a Tandem run dir?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trim_metrics(run_dir: Path, last_step: int) -> None:
    """Drop metrics.jsonl records after `last_step`: a resumed run logs those steps again. An
    eval line is tagged with the rollout that samples from the weights it evaluated (s + 1 for
    the eval after rollout s, ppo.generate.evaluation): it belongs to checkpoint s and is kept."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if _step_of(line) <= last_step]
    tmp = path.with_name(".metrics.jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def _step_of(line: str) -> float:
    """The rollout a record belongs to: its step, less one for an eval line (see trim_metrics)."""
    try:
        record = json.loads(line)
        return record["step"] - any(k.startswith("eval/") for k in record)
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")  # a line cut short by the crash: drop it
