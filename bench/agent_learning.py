"""The tiny agent's learning curve against the built-in tool loop's (docs/agents.md): reward per
rollout of two runs side by side, read from their run directories, and where their samples
first differ.

    python launch.py --recipe tiny_tools --seed S --run-dir LOOP
    python launch.py --recipe tiny_tools_agent --seed S --run-dir AGENT
    python -m bench.agent_learning --loop LOOP --agent AGENT

A run made in segments (--num-rollout 20 --save CKPT, then --load CKPT --num-rollout 40 in another
run dir) is given as its run dirs in order. Reads the runs' sample dumps (RUN_DIR/samples) and prints a markdown table
(rollout, the mean reward per sampled response of each, their relative difference, the agent's
rows and split sessions), the mean over the rollouts, and the first session whose turns differ
between the runs, with both: the point after which the two runs train on different data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def sessions(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The dumped rows of a rollout by session (group_index, session): an agent session that split
    is several rows (ppo.generate.sessions); a row without "session" is one."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        out.setdefault((r["group_index"], r.get("session", r["index"])), []).append(r)
    return out


def dumped(run_dirs: list[str]) -> dict[int, dict[tuple, list[dict]]]:
    """Each rollout's sessions from RUN_DIR/samples (a later dir's rollout wins: a resumed segment)."""
    out = {}
    for d in run_dirs:
        for path in sorted(Path(d, "samples").glob("rollout_*.jsonl")):
            out[int(path.stem.split("_")[1])] = sessions([json.loads(x) for x in path.read_text().splitlines()])
    return out


def reward(rollout: dict[tuple, list[dict]]) -> float:
    """The mean reward per sampled response (a session's records share its reward)."""
    return sum(rows[-1]["reward"] for rows in rollout.values()) / len(rollout)


def first_difference(loop: dict[int, dict], agent: dict[int, dict]) -> str:
    for step in sorted(set(loop) & set(agent)):
        for key, rows in loop[step].items():
            turns = [[t["text"] for t in r["turns"]] for r in rows]
            other = [[t["text"] for t in r["turns"]] for r in agent[step].get(key, [])]
            if turns != other:
                return (f"rollout {step}, session {key}: tool loop {turns!r} (reward {rows[-1]['reward']}) / agent "
                        f"{other!r} (reward {agent[step][key][-1]['reward'] if other else None})")
    return "none: every session of every rollout is the same"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loop", nargs="+", required=True, help="the tiny_tools run dir(s), in order")
    p.add_argument("--agent", nargs="+", required=True, help="the tiny_tools_agent run dir(s), in order")
    args = p.parse_args()
    loop, agent = dumped(args.loop), dumped(args.agent)
    steps = sorted(set(loop) & set(agent))
    print("| rollout | tool loop | agent | agent / loop - 1 | agent rows (splits) |\n|---|---|---|---|---|")
    for s in steps:
        a, b = reward(loop[s]), reward(agent[s])
        rows = sum(len(r) for r in agent[s].values())
        print(f"| {s} | {a:.4f} | {b:.4f} | {b / a - 1 if a else float('nan'):+.1%} | {rows} ({rows - len(agent[s])}) |")
    mean_loop, mean_agent = (sum(reward(r[s]) for s in steps) / len(steps) for r in (loop, agent))
    print(f"| mean of {len(steps)} | {mean_loop:.4f} | {mean_agent:.4f} | {mean_agent / mean_loop - 1:+.1%} | |")
    print("first differing sample:", first_difference(loop, agent))


if __name__ == "__main__":
    main()
