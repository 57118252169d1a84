"""A PPO job on a real GPU, measured phase by phase.

    python -m bench.iteration --out DIR -- LAUNCH_FLAGS...

Runs `ppo.loop.train` in this process on the launch.py flags after `--` (add --dump-samples:
the prompts' token counts come from RUN_DIR/samples), while a thread samples the GPU's
memory (`torch.cuda.mem_get_info`: every process on the device) and the host's (psutil,
else /proc/meminfo) every 0.2 s. Before the job it measures this machine's pinned copy rate
(the peer every memory move is compared with). After it, from RUN_DIR/events.jsonl and
metrics.jsonl, it prints per rollout:

- the driver's phases in order with the gaps between them (the memory handoffs run between
  phases): seconds, peak GPU memory in use, peak host memory in use;
- every memory move a role made (trainer offload/onload, engine release/resume): tags,
  device bytes freed or taken, bytes copied (grads are freed and zeroed, not copied),
  seconds, GB/s of the copies and the ratio to the pinned copy rate, and any allocations
  no tag covers;
- rollout tokens/s (response tokens over the rollout phase; with --train-async over the time
  the rollout generated beside the step before, perf/rollout_ahead_time, the rollout phase
  being only the wait for it) and training tokens/s (prompt and response tokens over each
  train phase); the trainers' own time in `train` (their `training` state) against the
  driver's phase, the difference being messaging; each engine's time generating within the
  step (with --train-async: the next rollout, beside the trainers);
- eval tokens/s (response tokens of the step's evals over its `eval` phases), beside rollout's;
- with --reward-model-path, the reward model's scoring tokens/s (its ranks' own count of the
  tokens they scored, over their time in `score`) and the share of them that was padding;
- the share of the step outside compute: the step's time less its compute phases
  (generation and scoring, the reward model's scoring, log-probs, values, advantages, the two
  train calls, eval), that is
  the handoffs, the weight sync, messaging and waiting.

Everything also goes to DIR/iteration.json. `--against OTHER_DIR` (another run's --out, e.g.
the synchronous plan beside a side-by-side one) adds the ratio of their steady iterations.

A side-by-side config (--train-async --colocate) runs as the launcher runs it
(ppo.gpu.side_by_side.choose): under MPS, or the synchronous plan, said in one line. MPS is
chosen before this process touches the GPU (the copy-rate probe and the memory sampler).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

from bench.peers import pinned_copy_rates
from ppo.gpu.plan_check import cuda_mismatches, cuda_peaks
from runtime.units import format_bytes

COMPUTE_PHASES = ("rollout", "reward_model", "log_probs", "values", "advantages", "critic_train", "actor_train", "eval")
MOVES = ("offload", "onload", "release", "resume")
GIB = 1 << 30


def host_used_bytes() -> tuple[int, int]:
    """(used, total) host memory in bytes: total less what the kernel could still give."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total - vm.available, vm.total
    except ImportError:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
        return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


class MemorySampler(threading.Thread):
    """(time, GPU bytes in use by every process, host bytes in use) every `period` seconds."""

    def __init__(self, period: float = 0.2):
        super().__init__(daemon=True)
        self.period, self.samples, self._done = period, [], threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            free, total = torch.cuda.mem_get_info()
            self.samples.append((time.time(), total - free, host_used_bytes()[0]))
            self._done.wait(self.period)

    def stop(self) -> list[tuple[float, int, int]]:
        self._done.set()
        self.join()
        return self.samples

    @staticmethod
    def peak(samples, t0: float, t1: float) -> tuple[float, float]:
        """(GPU GiB, host GiB) peaks over [t0, t1] (the nearest sample when none falls inside)."""
        inside = [s for s in samples if t0 <= s[0] <= t1] or [min(samples, key=lambda s: abs(s[0] - t0))]
        return max(s[1] for s in inside) / GIB, max(s[2] for s in inside) / GIB


def prompt_tokens(run_dir: Path, hf_checkpoint: str) -> dict[int, int]:
    """{step: prompt tokens of all its samples} from RUN_DIR/samples (--dump-samples)."""
    from transformers import AutoTokenizer

    tok, out = AutoTokenizer.from_pretrained(hf_checkpoint), {}
    for path in sorted((run_dir / "samples").glob("rollout_*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        out[int(path.stem.split("_")[1])] = sum(len(tok(r["prompt"], add_special_tokens=False).input_ids)
                                                for r in rows)
    return out


def analyse(run_dir: Path, samples, rates: dict[str, float], num_samples: int, prompts: dict[int, int]) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = {m["step"]: m for m in lines if "eval/weight_version" not in m}  # eval lines share the steps
    evals = {m["step"]: m for m in lines if "eval/weight_version" in m}
    phases: dict[int, list[dict]] = {}
    open_: dict[tuple[int, str], float] = {}
    for e in events:
        if e["event"] == "phase" and e.get("track") == "driver":
            key = (e["step"], e["phase"])
            if e["action"] == "begin":
                open_[key] = e["ts"]
            elif e["action"] == "end" and key in open_:
                phases.setdefault(e["step"], []).append({"phase": e["phase"], "t0": open_.pop(key), "t1": e["ts"]})
    moves = [e for e in events if e["event"] == "phase" and e.get("action") == "span" and e["phase"] in MOVES]
    training, generating = _state_spans(events, "training"), _state_spans(events, "generating")
    steps = []
    for step, spans in sorted(phases.items()):
        outer = next((s for s in spans if s["phase"] == "step"), None)
        if outer is None or step not in metrics:
            continue
        inner = sorted((s for s in spans if s["phase"] != "step"), key=lambda s: s["t0"])
        rows, cursor = [], outer["t0"]
        for s in inner + [{"phase": "(end of step)", "t0": outer["t1"], "t1": outer["t1"]}]:
            if s["t0"] - cursor > 1e-3:
                rows.append(_row(f"handoff before {s['phase']}", cursor, s["t0"], samples))
            if s["t1"] > s["t0"]:
                rows.append(_row(s["phase"], s["t0"], s["t1"], samples))
            cursor = max(cursor, s["t1"])
        m = metrics[step]
        step_s = outer["t1"] - outer["t0"]
        compute = sum(r["seconds"] for r in rows if r["phase"] in COMPUTE_PHASES)
        response = m["rollout/response_len"] * num_samples
        tokens = response + prompts.get(step, 0)
        ahead_s = m.get("perf/rollout_ahead_time")  # --train-async: generated during the step before
        rollout_s = ahead_s or next((r["seconds"] for r in rows if r["phase"] == "rollout"), 0.0)
        record = {
            "step": step, "step_s": step_s, "compute_s": compute, "outside_s": step_s - compute,
            "outside_share": (step_s - compute) / step_s, "phases": rows,
            "rollout_tokens_per_s": response / rollout_s if rollout_s else None,
            "response_tokens": response, "prompt_tokens": prompts.get(step),
            "moves": [_move(e, rates) for e in moves if outer["t0"] <= e["t0"] <= outer["t1"]],
            "training_role_s": _within(training, outer), "generating_role_s": _within(generating, outer),
            "rollout_ahead_s": ahead_s,
        }
        if "perf/reward_model_tokens_per_s" in m:  # ppo.generate.rewards
            record["reward_model_tokens_per_s"] = m["perf/reward_model_tokens_per_s"]
            record["reward_model_padding"] = m["perf/reward_model_padding"]
        for r in rows:
            if r["phase"] in ("critic_train", "actor_train") and prompts.get(step) is not None:
                record[f"{r['phase']}_tokens_per_s"] = tokens / r["seconds"]
        # an eval before the rollout is tagged with this step, one after it with the next (ppo.generate.evaluation)
        rollout_t0 = next((s["t0"] for s in inner if s["phase"] == "rollout"), outer["t0"])
        eval_spans = [(s, evals.get(step if s["t0"] < rollout_t0 else step + 1)) for s in inner if s["phase"] == "eval"]
        if eval_spans and all(m_ is not None for _, m_ in eval_spans):
            record["eval_response_tokens"] = sum(m_["eval/response_tokens"] for _, m_ in eval_spans)
            record["eval_tokens_per_s"] = record["eval_response_tokens"] / sum(s["t1"] - s["t0"] for s, _ in eval_spans)
        steps.append(record)
    return steps


def _row(phase: str, t0: float, t1: float, samples) -> dict:
    gpu, host = MemorySampler.peak(samples, t0, t1)
    return {"phase": phase, "seconds": t1 - t0, "gpu_peak_gib": gpu, "host_peak_gib": host}


def planned_peaks(run_dir: Path) -> dict[str, float]:
    """{phase: GPU 0's planned peak in GiB} from the run's RUN_DIR/memory_plan.json (ppo.gpu.memory_plan)."""
    path = run_dir / "memory_plan.json"
    if not path.exists():
        return {}
    return {p["phase"]: p["peak"] / GIB for p in json.loads(path.read_text())["phases"] if p["gpu"] == 0}


def allocator_report(step: int, rows: list[dict], mismatches: list[str]) -> str:
    """Step `step`'s plan beside the CUDA allocators' bytes, per phase and role (ppo.gpu.plan_check)."""
    lines = [f"step {step}: the memory plan against the CUDA allocators (GiB; called: the role ran in the phase)",
             f"  {'phase':<16}{'gpu':>4}  {'role':<12}{'plan':>8}{'allocator':>11}{'ratio':>7}  called"]
    for r in rows:
        got = "-" if r["measured"] is None else f"{r['measured'] / GIB:.2f}"
        ratio = f"{r['measured'] / r['planned']:.2f}" if r["measured"] is not None and r["planned"] else "-"
        lines.append(f"  {r['phase']:<16}{r['gpu']:>4}  {r['role']:<12}{r['planned'] / GIB:>8.2f}{got:>11}{ratio:>7}"
                     f"  {'yes' if r['called'] else 'no'}")
    lines += [f"  outside 10%: {m}" for m in mismatches] or ["  every phase within 10% of the plan"]
    return "\n".join(lines)


def startup_peak_gib(run_dir: Path, samples) -> float | None:
    """The GPU's peak before the first step: the trainers' builds and the engines' start."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line]
    first = next((e["ts"] for e in events if e["event"] == "phase" and e.get("phase") == "step"), None)
    return None if first is None or not samples else MemorySampler.peak(samples, samples[0][0], first)[0]


def _move(e: dict, rates: dict[str, float]) -> dict:
    into_gpu = e["phase"] in ("onload", "resume")
    # a rate counts bytes copied, not grads merely freed or zeroed; None: the role could not
    # tell (an sglang engine's weights), so no rate
    copied = e.get("copied", e["bytes"])
    gbps = copied / e["seconds"] / 1e9 if copied is not None and e["seconds"] > 0 else None
    return {"role": e["role"], "move": e["phase"], "tags": e.get("tags"), "bytes": e["bytes"], "copied": copied,
            "seconds": e["seconds"], "gb_per_s": gbps,
            "vs_pinned": None if gbps is None else gbps / rates["h2d" if into_gpu else "d2h"],
            "untracked": e.get("untracked", [])}


def _within(spans: dict[str, list[tuple[float, float]]], outer: dict) -> dict[str, float]:
    """{role: seconds of its spans that begin within the step `outer`}."""
    return {role: sum(t1 - t0 for t0, t1 in spans_ if outer["t0"] <= t0 <= outer["t1"]) for role, spans_ in spans.items()}


def _state_spans(events: list[dict], state: str) -> dict[str, list[tuple[float, float]]]:
    spans: dict[str, list[tuple[float, float]]] = {}
    began: dict[str, float] = {}
    for e in events:
        if e["event"] != "state":
            continue
        if e["new"] == state:
            began[e["role"]] = e["ts"]
        elif e["old"] == state and e["role"] in began:
            spans.setdefault(e["role"], []).append((began.pop(e["role"]), e["ts"]))
    return spans


def steady_ratio(steps: list[dict], other: list[dict], *, name: str) -> str:
    """This run's steady iteration against `other`'s (the synchronous plan's): the mean step time
    over steps 1 .. n-2 of this run (step 0 generates without a rollout ahead; with
    --train-async the last step has none generating beside it) and over the same steps of
    `other`, where every step after 0 is steady (one cut short of this run's still compares)."""
    mine = [s["step_s"] for s in steps[1:-1]]
    theirs = [s["step_s"] for s in other[1:len(steps) - 1]]
    if not mine or not theirs:
        return (f"steady iteration against {name}: needs 3 steps here and 2 in {name} "
                f"({len(steps)} and {len(other)} ran)")
    a, b = sum(mine) / len(mine), sum(theirs) / len(theirs)
    return (f"steady iteration (steps 1..{len(steps) - 2}): {a:.2f} s here, "
            f"{b:.2f} s in {name} (steps 1..{len(theirs)}): {a / b:.2f}x")


def report(steps: list[dict], rates: dict[str, float]) -> str:
    lines = [f"pinned copy peer: D2H {rates['d2h']:.1f} GB/s, H2D {rates['h2d']:.1f} GB/s"]
    for s in steps:
        lines.append(f"\nstep {s['step']}: {s['step_s']:.2f} s, compute {s['compute_s']:.2f} s, outside compute "
                     f"{s['outside_s']:.2f} s ({100 * s['outside_share']:.1f}%)")
        lines.append(f"  {'phase':<34}{'s':>8}{'GPU peak GiB':>14}{'plan GiB':>10}{'host peak GiB':>15}")
        for r in s["phases"]:
            plan = f"{r['plan_gib']:.1f}" if r.get("plan_gib") is not None else "-"
            lines.append(f"  {r['phase']:<34}{r['seconds']:>8.3f}{r['gpu_peak_gib']:>14.1f}{plan:>10}"
                         f"{r['host_peak_gib']:>15.1f}")
        rate = s["rollout_tokens_per_s"]
        ahead = f" (generated in {s['rollout_ahead_s']:.2f} s beside the step before)" if s.get("rollout_ahead_s") else ""
        lines.append(f"  rollout: {s['response_tokens']:.0f} response tokens, "
                     f"{rate:,.0f} tok/s{ahead}" if rate else "  rollout: no tokens")
        if s.get("eval_tokens_per_s"):
            ratio = f" ({s['eval_tokens_per_s'] / rate:.2f}x rollout)" if rate else ""
            lines.append(f"  eval: {s['eval_response_tokens']:.0f} response tokens, "
                         f"{s['eval_tokens_per_s']:,.0f} tok/s{ratio}")
        if "reward_model_tokens_per_s" in s:
            lines.append(f"  reward model: {s['reward_model_tokens_per_s']:,.0f} tok/s scored "
                         f"({100 * s['reward_model_padding']:.1f}% of its micro-batches padding)")
        for key in ("critic_train_tokens_per_s", "actor_train_tokens_per_s"):
            if key in s:
                lines.append(f"  {key.removesuffix('_tokens_per_s')}: {s[key]:,.0f} tok/s "
                             f"({s['prompt_tokens'] + s['response_tokens']:.0f} tokens)")
        for role, sec in s["training_role_s"].items():
            if sec:
                lines.append(f"  {role} inside train: {sec:.3f} s")
        for role, sec in s["generating_role_s"].items():
            if sec:
                lines.append(f"  {role} generating: {sec:.3f} s")
        lines += [_move_line(m) for m in s["moves"]]
    return "\n".join(lines)


def _move_line(m: dict) -> str:
    copied, rate = m["copied"], m["gb_per_s"]
    line = f"  {m['role']:<10} {m['move']:<8} {','.join(m['tags'] or []):<28} {m['bytes'] / 1e9:>7.2f} GB "
    line += f"{'?' if copied is None else f'{copied / 1e9:.2f}':>7} GB copied {m['seconds']:>7.3f} s "
    if copied == 0:
        line += f"{'(freed or allocated, nothing copied)':>24}"
    elif rate is not None:
        line += f"{rate:>6.1f} GB/s {m['vs_pinned']:>5.2f}x pinned"
    if m["untracked"]:
        line += f"  untracked {', '.join(format_bytes(b) for b in m['untracked'])}"
    return line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.iteration", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for iteration.json")
    parser.add_argument("--against", help="another run's --out: print the ratio of the steady iterations")
    args = parser.parse_args(argv[:split])
    from ppo.config.cli import build_parser, parse_cli
    from ppo.config import samples_per_rollout
    from ppo.loop import train
    from ppo.gpu.side_by_side import choose

    cfg, _ = parse_cli(build_parser(prog="launch.py"), argv[split + 1:])
    sm = choose(cfg)
    if sm is not None:
        print(f"side by side: {sm.fallback or f'under MPS ({sm.event()})'}", flush=True)
        cfg = sm.cfg
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rates = pinned_copy_rates()
    used, total = host_used_bytes()
    print(f"host memory: {used / GIB:.1f} of {total / GIB:.1f} GiB in use before the job", flush=True)
    sampler = MemorySampler()
    sampler.start()
    error = None
    try:
        train(cfg, sm=sm)
    except BaseException as e:  # the measurements of what ran are still wanted
        error = "".join(traceback.format_exception(e))
        print(error, file=sys.stderr, flush=True)
    finally:
        if sm is not None:
            sm.close()
    samples = sampler.stop()
    run_dir = Path(cfg.logging.run_dir)
    prompts = {}
    if (run_dir / "samples").is_dir():
        from ppo.setup.generated import resolve_paths  # the model directory of a generated:NAME checkpoint

        prompts = prompt_tokens(run_dir, resolve_paths(cfg, run_dir)[0])
    steps = analyse(run_dir, samples, rates, samples_per_rollout(cfg), prompts)
    plan = planned_peaks(run_dir)
    for r in (r for s in steps for r in s["phases"]):
        r["plan_gib"] = plan.get(r["phase"])
    print(report(steps, rates), flush=True)
    builds = {k: round(v, 2) for k, v in plan.items() if k.startswith("build")}
    startup = startup_peak_gib(run_dir, samples)
    if startup is not None:
        print(f"start-up: GPU peak {startup:.1f} GiB; planned builds {builds or '-'} GiB", flush=True)
    allocators = {s["step"]: cuda_peaks(run_dir, s["step"]) for s in steps} if (run_dir / "memory_plan.json").exists() else {}
    if not any(r["measured"] is not None for rows in allocators.values() for r in rows):
        allocators = {}  # no role reported a CUDA allocator: fake GPUs or the CPU
    for step, rows in allocators.items():
        print(allocator_report(step, rows, cuda_mismatches(run_dir, step)), flush=True)
    if args.against:
        other = json.loads((Path(args.against) / "iteration.json").read_text())["steps"]
        print(steady_ratio(steps, other, name=Path(args.against).name), flush=True)
    (out / "iteration.json").write_text(json.dumps(
        {"pinned_gb_per_s": rates, "steps": steps, "error": error, "planned_gib": plan, "startup_peak_gib": startup,
         "allocators": allocators,
         "memory_samples": [(round(t, 3), g, h) for t, g, h in samples]}, indent=1))
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
