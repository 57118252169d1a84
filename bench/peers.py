"""Peers the GPU benchmarks compare with, measured in the same run: copy rates between a GPU
and page-locked host memory, and a device memcpy."""

from __future__ import annotations

import time

import torch


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int = 3) -> float:
    """Best time of `repeats` copies of src into dst, after one warm-up copy."""
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def pinned_copy_rates(nbytes: int = 2 << 30, repeats: int = 3) -> dict[str, float]:
    """GB/s of a device<->pinned-host copy of `nbytes` (torch's pinned allocator), each direction."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = {name: nbytes / copy_seconds(dst, src, repeats) / 1e9
             for name, dst, src in (("d2h", host, dev), ("h2d", dev, host))}
    del dev, host
    torch.cuda.empty_cache()
    return rates


def memcpy_gbps(nbytes: int = 4 << 30, repeats: int = 3) -> float:
    """Device-to-device copy rate (bytes copied per second): the weight sync's ceiling."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rate = nbytes / copy_seconds(torch.empty_like(src), src, repeats) / 1e9
    del src
    torch.cuda.empty_cache()
    return rate
