"""The tiny agent's learning curve against the built-in tool loop's (docs/agents.md): reward per
rollout of two runs side by side, read from their run directories, and where their samples
first differ.

    python launch.py --recipe tiny_tools --seed S --run-dir LOOP
    python launch.py --recipe tiny_tools_agent --seed S --run-dir AGENT
    python -m bench.agent_learning --loop LOOP --agent AGENT

A run made in segments (--num-rollout 20 --save CKPT, then --load CKPT --num-rollout 40 in another
run dir) is given as its run dirs in order. Prints a markdown table (rollout, the two
rollout/raw_reward, their relative difference), the mean over the rollouts, and the first sample
(rollout, index) whose turns differ between the runs, with both turns: the point after which
the two runs train on different data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rewards(run_dirs: list[str]) -> dict[int, float]:
    """rollout/raw_reward by step over the run dirs (a later dir's step wins: a resumed segment)."""
    out = {}
    for d in run_dirs:
        for line in Path(d, "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "rollout/raw_reward" in row:
                out[row["step"]] = row["rollout/raw_reward"]
    return out


def samples(run_dirs: list[str], step: int) -> list[dict] | None:
    for d in reversed(run_dirs):
        path = Path(d, "samples", f"rollout_{step:05d}.jsonl")
        if path.exists():
            return [json.loads(line) for line in path.read_text().splitlines()]
    return None


def first_difference(loop: list[str], agent: list[str], steps: list[int]) -> str:
    for step in steps:
        a, b = samples(loop, step), samples(agent, step)
        if a is None or b is None:
            return f"rollout {step}: samples not dumped"
        for x, y in zip(a, b):
            if [t["text"] for t in x["turns"]] != [t["text"] for t in y["turns"]]:
                return (f"rollout {step}, sample {x['index']}: tool loop {[t['text'] for t in x['turns']]!r} "
                        f"(reward {x['reward']}) / agent {[t['text'] for t in y['turns']]!r} (reward {y['reward']})")
        if len(a) != len(b):
            return f"rollout {step}: {len(a)} samples / {len(b)}"
    return "none: every sample of every rollout is the same"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", nargs="+", required=True, help="the tiny_tools run dir(s), in order")
    p.add_argument("--agent", nargs="+", required=True, help="the tiny_tools_agent run dir(s), in order")
    args = p.parse_args()
    loop, agent = rewards(args.loop), rewards(args.agent)
    steps = sorted(set(loop) & set(agent))
    print("| rollout | tool loop | agent | agent / loop - 1 |\n|---|---|---|---|")
    for s in steps:
        rel = agent[s] / loop[s] - 1 if loop[s] else float("nan")
        print(f"| {s} | {loop[s]:.4f} | {agent[s]:.4f} | {rel:+.1%} |")
    mean_loop, mean_agent = (sum(r[s] for s in steps) / len(steps) for r in (loop, agent))
    print(f"| mean of {len(steps)} | {mean_loop:.4f} | {mean_agent:.4f} | {mean_agent / mean_loop - 1:+.1%} |")
    print("first differing sample:", first_difference(args.loop, args.agent, steps))


if __name__ == "__main__":
    main()
