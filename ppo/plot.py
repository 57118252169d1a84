"""`python -m ppo.plot RUN_DIR [--out FILE]`: reward (with each eval set's pass@1 beside it), KL,
value loss, step time, train-inference mismatch and TIS clipping of a run, and a stacked bar
of each step's time by phase (the `perf/*_time` metrics, eval's included), as a PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ppo.observe.metrics_file import read_metrics

PANELS = (
    ("rollout/raw_reward", "reward (rollout) and eval pass@1"),
    ("train/ppo_kl", "PPO KL (old vs new policy)"),
    ("train/critic-value_loss", "critic value loss"),
    ("perf/step_time", "step time (s)"),
    ("train/mis_k3_kl", "mismatch k3 KL, trainer vs engine"),
    ("train/tis_clipfrac", "TIS clip fraction"),
)
BAR_LABELS = {"train": "actor_train", "offload": "handoffs (offload/onload)"}  # perf/train_time is the actor's


def step_phases(rows: list[dict]) -> tuple[list[str], list[int], list[list[float]]]:
    """(phases, steps, seconds[phase][step]) from the `perf/*_time` metrics; "other" is the
    step time the phases do not cover (driver work between them)."""
    keys = {k: None for r in sorted(rows, key=len, reverse=True) for k in r}  # the loop's order
    phases = [k.removeprefix("perf/").removesuffix("_time") for k in keys
              if k.startswith("perf/") and k.endswith("_time") and k != "perf/step_time"]
    rows = [r for r in rows if "perf/step_time" in r]
    seconds = [[r.get(f"perf/{p}_time", 0.0) for r in rows] for p in phases]
    other = [max(0.0, r["perf/step_time"] - sum(col)) for r, col in zip(rows, zip(*seconds))] if seconds \
        else [r["perf/step_time"] for r in rows]
    return phases + ["other"], [r["step"] for r in rows], seconds + [other]


def plot(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    panel_rows = (len(PANELS) + 1) // 2
    fig = plt.figure(figsize=(10, 3.2 * (panel_rows + 1)), constrained_layout=True)
    grid = fig.add_gridspec(panel_rows + 1, 2)
    axes = [fig.add_subplot(grid[i // 2, i % 2]) for i in range(len(PANELS))]
    _phase_bars(fig.add_subplot(grid[panel_rows, :]), rows)
    for ax, (key, label) in zip(axes, PANELS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker=".", linewidth=1, label="rollout reward")
            if key == "rollout/raw_reward":
                _eval_curves(ax, rows)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label)
        ax.set_xlabel("rollout")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def eval_curves(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{eval set name: [(step, pass@1)]} from the eval lines of metrics.jsonl (ppo.generate.evaluation)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("eval/") and k.endswith("-pass@1"):
                curves.setdefault(k.removeprefix("eval/").removesuffix("-pass@1"), []).append((r["step"], v))
    return curves


def _eval_curves(ax, rows: list[dict]) -> None:
    curves = eval_curves(rows)
    for name, pts in curves.items():
        ax.plot(*zip(*pts), marker="o", linewidth=1.5, label=f"eval {name} pass@1")
    if curves:
        ax.legend(fontsize="small")


def _phase_bars(ax, rows: list[dict]) -> None:
    phases, steps, seconds = step_phases(rows)
    bottom = [0.0] * len(steps)
    for phase, col in zip(phases, seconds):
        ax.bar(steps, col, bottom=bottom, label=BAR_LABELS.get(phase, phase), width=0.85)
        bottom = [b + c for b, c in zip(bottom, col)]
    ax.set_title("step time by phase (s)")
    ax.set_xlabel("rollout")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.grid(alpha=0.3, axis="y")


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
    num_rollouts = sum("perf/step_time" in r for r in rows)
    out = plot(rows, args.out or args.run_dir / "curves.png", f"{args.run_dir.name}: {num_rollouts} rollouts")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
