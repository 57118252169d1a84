"""Whether this process's GPU computes what a role runs on it: bf16 GEMMs in the three layouts
of a linear layer (the forward's x @ w^T, the backward's dy @ w and dy^T @ x), and the SM-copy
onload of a trainer's offloaded state (roles.device.host_to_device from a page-locked block).
Under MPS at some SM shares cuBLAS leaves GEMM outputs unwritten and reports no error.

On the H200 (CUDA 13, torch 2.11), in an MPS client at 60% or 75% of the SMs (78 or 98 SMs),
`F.linear` leaves its output block untouched for 46-158 of ~160 sizes per shape, from the tiny
model's 64x256 to Qwen3-4B's 4096x24576, whichever BLAS library torch prefers; at 25, 50, 90
and 100% (32, 66, 118, 132 SMs) and without MPS every forward is right (docs/journal/, "Side
by side: the NaN's cause"). A trainer also runs the backward's two layouts and the onload
copy, beside a busy engine, at its own priority. So ppo.gpu.side_by_side.choose runs this module in
each role's own MPS client (its share and priority), all at once and for a few seconds
(--seconds), as the roles run side by side. And since a client checked right at launch might
go wrong later under the other's load, each role under MPS checks a few GEMMs again before
each train or generate call (`check_in_run`) and stops the run if they come out wrong.

    python -m roles.compute_check [--seconds S]
    # JSON {"sms", "rounds", "checked", "wrong": [[op, M, K, N], ...], "copy": [bytes, ...]}; exit 1 if any

Each GEMM output is made to land on a block just filled with NaN (the caching allocator hands
the freed block back for the same size), so an unwritten output cannot pass by chance as zeros;
each copy lands on bytes just set to the complement of its source.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from time import monotonic
from typing import Callable

import torch

from roles.device import HostBlock, host_to_device

# (M, K, N) of a linear y[M, N] = x[M, K] @ w[N, K]^T: sizes that failed at 60 or 75% on the
# H200, the tiny model's and Qwen3-4B's layer shapes, and a few that passed
SHAPES = [(134, 64, 256), (260, 64, 128), (519, 128, 64), (71, 4096, 4096), (211, 4096, 4096),
          (1, 4096, 24576), (162, 4096, 24576), (8, 64, 256), (1024, 64, 256), (2048, 4096, 4096)]
# The in-run check's sizes: the tiny model's that failed at both 60 and 75% (< 1 ms on the GPU)
CANARY_SHAPES = SHAPES[:3]
MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # set in each side-by-side role (runtime.mps.client_env)
# A linear's three GEMMs: the output's shape and its two operands, from x, w and dy = dL/dy
LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "forward": lambda x, w, dy: (x, w.t()),  # y = x @ w^T
    "dgrad": lambda x, w, dy: (dy, w),  # dx = dy @ w
    "wgrad": lambda x, w, dy: (dy.t(), x),  # dw = dy^T @ x
}
# Bytes of the onload copies: large, and odd sizes that take host_to_device's byte-wise path
COPY_SIZES = [64 << 20, (1 << 20) + 3, 4096 + 2]


def wrong_gemms(device: str | torch.device, matmul: Callable = torch.matmul,
                shapes: list[tuple[int, int, int]] = SHAPES) -> list[tuple[str, int, int, int]]:
    """(layout, M, K, N) of each bf16 GEMM whose output differs from a float32 reference beyond
    bf16's rounding (an unwritten output is NaN: the block was just filled with it)."""
    g = torch.Generator(device=device).manual_seed(0)
    bad = []
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.05
        dy = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g)
        for layout, operands in LAYOUTS.items():
            a, b = operands(x, w, dy)
            torch.full((a.shape[0], b.shape[1]), float("nan"), device=device, dtype=torch.bfloat16)  # freed, reused below
            out = matmul(a, b).float()
            ref = a.float() @ b.float()
            if not torch.allclose(out, ref, rtol=0.02, atol=0.02 * float(ref.abs().max())):
                bad.append((layout, m, k, n))
    return bad


class ComputeWrong(RuntimeError):
    """This process's GPU computed a check wrong; the message says where and what to change."""


def under_mps() -> bool:
    """Whether this process is a CUDA MPS client held to an SM share (a side-by-side role)."""
    return MPS_SHARE_ENV in os.environ and torch.cuda.is_available()


def check_in_run(who: str, device: str | torch.device = "cuda", matmul: Callable = torch.matmul) -> None:
    """Under MPS, raise ComputeWrong naming `who` when this process's bf16 GEMMs come out
    wrong now (CANARY_SHAPES in the three layouts); nothing elsewhere. A role calls it before
    each train or generate call, beside the other role's work, so that a wrong share stops
    the run before a result is built on garbage."""
    if not under_mps():
        return
    wrong = wrong_gemms(device, matmul, CANARY_SHAPES)
    if wrong:
        layout, m, k, n = wrong[0]
        raise ComputeWrong(
            f"{who}: in its MPS client ({os.environ[MPS_SHARE_ENV]}% of the SMs) {len(wrong)} of "
            f"{len(CANARY_SHAPES) * len(LAYOUTS)} bf16 GEMMs came out wrong (the first: the {layout} GEMM of a "
            f"linear of {m} x {k} -> {n}; roles.compute_check), though the launch check passed: stopped before "
            f"using them. Choose other --engine-sm-percentage / --trainer-sm-percentage / --trainer-mps-priority, "
            f"or run without --train-async")


def wrong_copies(device: str | torch.device, copy: Callable = host_to_device,
                 sizes: list[int] = COPY_SIZES) -> list[int]:
    """The sizes whose onload from a page-locked host block came back different."""
    device = torch.device(device)
    block = HostBlock(sizes, pin=device.type == "cuda")
    try:
        bad = []
        for size, src in zip(sizes, block.views):
            src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
            dst = torch.bitwise_not(src).to(device)
            copy(dst, src)
            if not torch.equal(dst.cpu(), src):
                bad.append(size)
        return bad
    finally:
        block.free()


def check(device: str | torch.device, seconds: float = 0.0, shapes: list[tuple[int, int, int]] = SHAPES) -> dict:
    """Both checks, repeated until `seconds` have passed (at least once): the wrong ones of any round."""
    wrong, copies, rounds = set(), set(), 0
    start = monotonic()
    while rounds == 0 or monotonic() - start < seconds:
        wrong.update(wrong_gemms(device, shapes=shapes))
        copies.update(wrong_copies(device))
        rounds += 1
    return {"rounds": rounds, "checked": len(shapes) * len(LAYOUTS) + len(COPY_SIZES),
            "wrong": sorted(map(list, wrong)), "copy": sorted(copies)}


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--seconds", type=float, default=0.0, help="repeat the checks this long (at least once)")
    seconds = args.parse_args(argv).seconds
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device in this process"}))
        return 2
    report = check("cuda", seconds)
    torch.cuda.synchronize()
    print(json.dumps({"sms": torch.cuda.get_device_properties(0).multi_processor_count, **report}))
    return 1 if report["wrong"] or report["copy"] else 0


if __name__ == "__main__":
    sys.exit(main())
