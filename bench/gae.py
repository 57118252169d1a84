"""Micro-benchmark: algorithms.compute_gae against a plain per-time-step loop.

    python -m bench.gae [--batch 256] [--length 8192] [--repeats 5] [--json FILE]

The loop is the textbook masked GAE (one vectorised step per token, walking back in
time, as verl and TRL write it); both run in float32 on the same random batch with
interior mask holes and ragged trailing padding, and the table shows each one's
error against the same loop run in float64.
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from algorithms import compute_gae


def loop_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-time-step masked GAE: the peer being measured."""
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    columns = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * running
        running = m[:, t] * step + (1 - m[:, t]) * running
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1)
    return advantages, advantages + values


def make_batch(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random rewards/values and a mask with interior holes and ragged trailing padding."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen)
    values = torch.randn(batch, length, generator=gen)
    holes = torch.rand(batch, length, generator=gen) < 0.1
    lengths = torch.randint(length // 2, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths) & ~holes
    return rewards, values, mask.float()


def time_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocator, first-call dispatch
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def run(batch: int, length: int, repeats: int, gamma: float, lam: float) -> dict:
    rewards, values, mask = make_batch(batch, length)
    valid = mask.bool()
    with torch.no_grad():
        exact = loop_gae(rewards.double(), values.double(), mask.double(), gamma, lam)[0]

        def max_error(advantages: torch.Tensor) -> float:
            return (advantages.double() - exact)[valid].abs().max().item()

        loop_ms = time_ms(lambda: loop_gae(rewards, values, mask, gamma, lam), repeats)
        ours_ms = time_ms(lambda: compute_gae(rewards, values, mask, gamma, lam), repeats)
        return {
            "batch": batch,
            "length": length,
            "gamma": gamma,
            "lam": lam,
            "threads": torch.get_num_threads(),
            "loop_ms": loop_ms,
            "compute_gae_ms": ours_ms,
            "ratio": loop_ms / ours_ms,
            "loop_max_error": max_error(loop_gae(rewards, values, mask, gamma, lam)[0]),
            "compute_gae_max_error": max_error(compute_gae(rewards, values, mask, gamma, lam)[0]),
        }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    args = parser.parse_args(argv)

    results = [run(args.batch, args.length, args.repeats, gamma, lam) for gamma, lam in ((1.0, 1.0), (1.0, 0.95))]
    print(f"GAE on [{args.batch}, {args.length}], float32, {torch.get_num_threads()} threads, median of {args.repeats}")
    print("error = max |advantage - float64 loop| over valid tokens")
    print(
        f"{'gamma':>5} {'lam':>5} | {'loop ms':>8} {'error':>8} | {'compute_gae ms':>14} {'error':>8} | "
        f"{'ratio loop/ours':>15}"
    )
    for r in results:
        print(
            f"{r['gamma']:>5} {r['lam']:>5} | {r['loop_ms']:>8.1f} {r['loop_max_error']:>8.1e} | "
            f"{r['compute_gae_ms']:>14.1f} {r['compute_gae_max_error']:>8.1e} | {r['ratio']:>14.1f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
