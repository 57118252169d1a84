"""Whether this process's GPU really computes bf16 GEMMs: under MPS at some SM shares, cuBLAS
leaves the output of many GEMMs unwritten and reports no error.

Found on the H200 (CUDA 13, torch 2.11, 2026-12-04; docs/benchmarks.md, side by side): in an
MPS client at 60% or 75% of the SMs (78 or 98 SMs), `F.linear` returned its output block
untouched for 46-158 of ~160 sizes per shape, from the tiny model's 64x256 to Qwen3-4B's
4096x24576, whichever BLAS library torch prefers; at 25, 50, 90 and 100% (32, 66, 118, 132
SMs) and without MPS, every one was right. The side-by-side run's trainers, at 75%, skipped
every update as non-finite. So a share is checked before a run relies on it
(ppo.side_by_side.choose runs this module in an MPS client at each share).

    python -m roles.gemm_check     # JSON {"sms", "checked", "unwritten": [[M, K, N], ...]}; exit 1 if any

Each output is made to land on a block just filled with NaN (the caching allocator hands the
freed block back for the same size), so an unwritten output cannot pass by chance as zeros.
"""

from __future__ import annotations

import json
import sys
from typing import Callable

import torch
import torch.nn.functional as F

# (M, K, N) of y[M, N] = x[M, K] @ w[N, K]^T: sizes that failed at 60 or 75% on the H200,
# the tiny model's and Qwen3-4B's layer shapes, and a few that passed
SHAPES = [(134, 64, 256), (260, 64, 128), (519, 128, 64), (71, 4096, 4096), (211, 4096, 4096),
          (1, 4096, 24576), (162, 4096, 24576), (8, 64, 256), (1024, 64, 256), (2048, 4096, 4096)]


def unwritten_gemms(device: str | torch.device, linear: Callable = F.linear) -> list[tuple[int, int, int]]:
    """The SHAPES whose bf16 `linear` output differs from a float32 reference beyond bf16's
    rounding (an unwritten output is NaN: the block was just filled with it)."""
    g = torch.Generator(device=device).manual_seed(0)
    bad = []
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.05
        torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)  # freed at once, reused below
        y = linear(x, w).float()
        ref = x.float() @ w.float().t()
        if not torch.allclose(y, ref, rtol=0.02, atol=0.02 * float(ref.abs().max())):
            bad.append((m, k, n))
    return bad


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device in this process"}))
        return 2
    bad = unwritten_gemms("cuda")
    torch.cuda.synchronize()
    print(json.dumps({"sms": torch.cuda.get_device_properties(0).multi_processor_count, "checked": len(SHAPES),
                      "unwritten": [list(s) for s in bad]}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
