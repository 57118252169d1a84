"""Fault injection into a running tiny_ppo job, and the table of what it survived.

    python -m bench.faults [--json FILE] [--repeat N]

Each scenario starts a small tiny_ppo job (2 fake GPUs, real role processes), injects a
fault when the run's event log shows the moment it waits for, and reads what happened
from the same log and the sample dumps: whether the job recovered, how many samples were
lost (must be 0), the time from the fault to the supervisor seeing it, and the time until
the replacement was ready.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.job import start_job
from ppo.loop import TrainerDied, run
from ppo.recipes import tiny_ppo
from runtime import SupervisionFailed
from runtime.events import read_events


class Injector(threading.Thread):
    """Sends `sig` to `victim` the first time `trigger(event)` holds, reading the event log;
    with `times` > 1 it fires again at each later match (a restart storm)."""

    def __init__(self, job, victim: str, trigger, *, sig: int = signal.SIGKILL, times: int = 1):
        super().__init__(daemon=True)
        self.job, self.victim, self.trigger, self.sig, self.times = job, victim, trigger, sig, times
        self.fired_at: list[float] = []
        self.stop = False

    def run(self):
        seen = 0
        while not self.stop and len(self.fired_at) < self.times:
            events = read_events(self.job.run_dir)
            for e in events[seen:]:
                if self.trigger(e) and len(self.fired_at) < self.times:
                    try:
                        self.job.sup.kill(self.victim, self.sig)
                    except (ProcessLookupError, KeyError):
                        continue
                    self.fired_at.append(time.time())
            seen = len(events)
            time.sleep(0.005)


def after_first_rollout(role: str, state: str):
    """A trigger: `role` enters lifecycle `state` once rollout 0 has been logged."""
    logged = []

    def trigger(e: dict) -> bool:
        if e["event"] == "metrics":
            logged.append(e)
        return bool(logged) and e["event"] == "state" and e["role"] == role and e["new"] == state
    return trigger


def tiny_job_config(run_dir: Path, **values):
    return ensure_valid(override(tiny_ppo(), run_dir=str(run_dir), **values))


SCENARIOS = {
    # name: (victim, signal, trigger state, times, config overrides)
    "engine killed mid-generation": ("rollout-0", signal.SIGKILL, ("rollout-0", "generating"), 1, {}),
    "scorer killed mid-scoring": ("reward-0", signal.SIGKILL, ("reward-0", "scoring"), 1, {}),
    "scorer hung (SIGSTOP) mid-scoring": ("reward-0", signal.SIGSTOP, ("reward-0", "scoring"), 1, {}),
    "trainer killed mid-training": ("actor.1", signal.SIGKILL, ("actor.1", "training"), 1, {}),
    "restart storm (engine killed 5 times)": ("rollout-1", signal.SIGKILL, ("rollout-1", "generating"), 5, {}),
}


def run_scenario(name: str, workdir: Path) -> dict:
    victim, sig, (role, state), times, values = SCENARIOS[name]
    num_rollout, batch = 4, 32
    cfg = tiny_job_config(workdir / "run", num_rollout=num_rollout, rollout_batch_size=batch, **values)
    job = start_job(cfg)
    inj = Injector(job, victim, after_first_rollout(role, state), sig=sig, times=times)
    inj.start()
    outcome = "completed"
    try:
        run(job)
    except (TrainerDied, SupervisionFailed) as e:  # the expected ways to stop; anything else propagates
        outcome = f"stopped: {type(e).__name__}"
    finally:
        inj.stop = True
        job.close()
    events = read_events(job.run_dir)
    deaths = [e for e in events if e["event"] in ("died", "hung") and e.get("role") == victim]
    readies = [e for e in events if e["event"] == "ready" and e.get("role") == victim]
    # a logged rollout must hold every sample exactly once; a completed run logs them all
    expected = batch * cfg.rollout.n_samples_per_prompt
    lost = 0
    for step in range(num_rollout):
        f = job.run_dir / "samples" / f"rollout_{step:05d}.jsonl"
        if f.exists():
            indices = [json.loads(x)["index"] for x in f.read_text().splitlines()]
            lost += expected - len(set(indices)) + (len(indices) - len(set(indices)))
        elif outcome == "completed":
            lost += expected
    first = inj.fired_at[0] if inj.fired_at else None
    detect = (deaths[0]["ts"] - first) if first and deaths else None
    recovered_ready = [e for e in readies if first and e["ts"] > first]
    return {"fault": name, "injected": len(inj.fired_at), "outcome": outcome,
            "recovered": len(recovered_ready) if outcome == "completed" else 0, "samples_lost": lost,
            "detect_s": detect, "recover_s": (recovered_ready[0]["ts"] - first) if recovered_ready and first else None}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="run only the scenarios whose name contains this")
    args = ap.parse_args(argv)
    rows = []
    for name in SCENARIOS:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="tdm-faults-") as d:
            rows.append(run_scenario(name, Path(d)))
        print(f"done: {name}", flush=True)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\n{'fault':<40}{'injected':>9}{'recovered':>10}{'lost':>6}{'detect s':>10}{'recover s':>10}  outcome")
    for r in rows:
        print(f"{r['fault']:<40}{r['injected']:>9}{r['recovered']:>10}{r['samples_lost']:>6}"
              f"{fmt(r['detect_s']):>10}{fmt(r['recover_s']):>10}  {r['outcome']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
