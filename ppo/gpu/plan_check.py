"""A run's memory plan held against what its fake GPUs' ledgers saw, phase by phase.

On fake GPUs every role declares what it holds (runtime.fakegpu), so a phase's peak on a
device is exact: the device's total when the phase began (what the handoff before it left
there) or after any change within it. The plan (RUN_DIR/memory_plan.json, ppo.gpu.memory_plan)
must name the same peaks.
"""

from __future__ import annotations

import json
from pathlib import Path

from ppo.gpu.memory_plan import OUTSIDE_ALLOCATOR
from runtime.events import read_events
from runtime.fakegpu import FakeDevice


def phase_spans(run_dir: Path, step: int) -> dict[str, tuple[float, float]]:
    """{phase: (begin, end) unix time} of the driver's phases in `step` (the last span of a
    phase that ran more than once)."""
    spans, begun = {}, {}
    for e in read_events(run_dir):
        if e["event"] != "phase" or e.get("track") != "driver" or e.get("step") != step:
            continue
        if e["action"] == "begin":
            begun[e["phase"]] = e["ts"]
        elif e["action"] == "end" and e["phase"] in begun:
            spans[e["phase"]] = (begun.pop(e["phase"]), e["ts"])
    return spans


def ledger_peaks(run_dir: Path, step: int) -> dict[tuple[str, int], int]:
    """{(phase, gpu): peak bytes in the fake device's ledger} for the phases of `step`."""
    spans = phase_spans(run_dir, step)
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    peaks = {}
    for gpu in sorted({p["gpu"] for p in plan["phases"]}):
        usage = [h for h in FakeDevice(run_dir / "fakegpu", gpu).history() if h["kind"] == "usage"]
        for phase, (t0, t1) in spans.items():
            before = [h["total"] for h in usage if h["ts"] <= t0]
            peaks[phase, gpu] = max([before[-1] if before else 0] + [h["total"] for h in usage if t0 < h["ts"] <= t1])
    return peaks


def plan_mismatches(run_dir: Path, step: int, *, below: float = 0.0) -> list[str]:
    """Every planned phase of `step` whose ledger peak is above the plan's or more than `below`
    (a share) under it; [] when they agree. A phase's activations are planned for the longest
    prompt and response, so a step whose micro-batches were narrower peaks lower."""
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    seen = ledger_peaks(run_dir, step)
    out = []
    for p in plan["phases"]:
        key = (p["phase"], p["gpu"])
        if key not in seen:
            if not p["phase"].startswith("build"):  # start-up phases are not spans of a step
                out.append(f"phase {p['phase']} did not run in step {step}")
        elif not p["peak"] * (1 - below) <= seen[key] <= p["peak"]:
            out.append(f"phase {p['phase']} on GPU {p['gpu']}: the ledger peaked at {seen[key]} bytes, "
                       f"the plan says {p['peak']} ({p['held']})")
    return out


def _base_role(process: str) -> str:
    """The plan's name of a role process: a trainer rank `actor.3` is the plan's `actor`."""
    return process.split(".")[0]


def cuda_peaks(run_dir: Path, step: int) -> list[dict]:
    """On a real GPU: for each planned phase of `step` and each role the plan puts on that GPU,
    the CUDA allocator's bytes (the `cuda_memory` events of runtime.child) beside the plan's.

    A role called during the phase counts its allocator peak over those calls; a role idle in
    the phase counts what it held after its last call before the phase ended. The plan's
    CUDA contexts and allocator slack are left out: torch never reports them as allocated."""
    spans = phase_spans(run_dir, step)
    plan = json.loads((run_dir / "memory_plan.json").read_text())
    seen = [e for e in read_events(run_dir) if e["event"] == "cuda_memory"]
    rows = []
    for p in plan["phases"]:
        if p["phase"] not in spans:
            continue
        t0, t1 = spans[p["phase"]]
        for role, kinds in p["held"].items():
            mine = [e for e in seen if _base_role(e["role"]) == role and p["gpu"] in e["gpus"]]
            during = [e["peak"] for e in mine if e["began"] < t1 and e["ended"] > t0]
            before = [e["held"] for e in mine if e["ended"] <= t1]
            measured = max(during) if during else (before[-1] if before else None)
            rows.append({"phase": p["phase"], "gpu": p["gpu"], "role": role, "called": bool(during),
                         "planned": sum(v for k, v in kinds.items() if k not in OUTSIDE_ALLOCATOR),
                         "measured": measured})
    return rows


def cuda_mismatches(run_dir: Path, step: int, *, tolerance: float = 0.10) -> list[str]:
    """Every planned phase of `step` whose allocator total on a GPU (summed over its roles, as
    cuda_peaks measures them) is more than `tolerance` (a share) away from the plan's; [] when
    all agree, or a line saying what was not measured."""
    totals: dict[tuple[str, int], list[int]] = {}
    for r in cuda_peaks(run_dir, step):
        if r["measured"] is None:
            return [f"phase {r['phase']}: {r['role']} reported no CUDA memory (not on a GPU?)"]
        planned, measured = totals.setdefault((r["phase"], r["gpu"]), [0, 0])
        totals[r["phase"], r["gpu"]] = [planned + r["planned"], measured + r["measured"]]
    if not totals:
        return [f"no planned phase of step {step} ran"]
    return [f"phase {phase} on GPU {gpu}: the allocators held {measured} bytes at their peaks, "
            f"the plan says {planned} ({measured / planned:.2f}x)"
            for (phase, gpu), (planned, measured) in totals.items()
            if planned and abs(measured - planned) > tolerance * planned]
