"""`python -m ppo.plot RUN_DIR [--out FILE]`: reward, KL, value loss and step time of a run, as a PNG."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (
    ("rollout/raw_reward", "reward (mean over rollout)"),
    ("train/ppo_kl", "PPO KL (old vs new policy)"),
    ("train/critic-value_loss", "critic value loss"),
    ("perf/step_time", "step time (s)"),
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a Tandem run dir?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), constrained_layout=True)
    for ax, (key, label) in zip(axes.flat, PANELS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker=".", linewidth=1)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppo.plot", description=__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/curves.png)")
    args = ap.parse_args(argv)
    try:
        rows = read_metrics(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = plot(rows, args.out or args.run_dir / "curves.png", f"{args.run_dir.name}: {len(rows)} rollouts")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
