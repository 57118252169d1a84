"""Adam on the CPU: what an optimizer step kept in host memory costs (megatron-core's
`optimizer_cpu_offload` steps the offloaded share on the CPU), for the memory plans of GPUs
too small to hold a trainer's optimizer.

    python -m bench.cpu_adam [--params 268435456] [--steps 3]

torch AdamW (float32 params, grads and moments) on `--params` parameters in 64 tensors, its
fused and foreach forms, with every CPU thread torch has; prints parameters per second (the
median of `--steps` steps after one warm-up) as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def params_per_second(num_params: int, *, fused: bool, steps: int) -> float:
    params = [torch.nn.Parameter(torch.zeros(num_params // 64)) for _ in range(64)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-6, fused=fused, foreach=not fused)
    opt.step()  # creates the moments
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return num_params / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_adam", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = {"params": args.params, "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    for name, fused in (("fused", True), ("foreach", False)):
        out[f"{name}_params_per_s"] = params_per_second(args.params, fused=fused, steps=args.steps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
