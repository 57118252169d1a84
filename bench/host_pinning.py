"""Page-locked host memory for offload: what the first offload of a tag pays to get it.

    python -m bench.host_pinning [--gib 8]

Rows, each a fresh block of the same size, then one device->host copy into it:
- torch pinned: torch.empty(pin_memory=True) (cudaHostAlloc, rounded up to a power of two);
- host block: roles.device.HostBlock(touch=False) (malloc, then cudaHostRegister, which
  faults every page in on one kernel thread);
- host block, touched first: HostBlock's default, the same after writing every page from
  roles.device.TOUCH_THREADS threads (what the trainers' offload and the rollout engine
  use); run with OMP_NUM_THREADS=1, as the role processes are, to check it does not rely on
  torch's intra-op threads.
Each row prints seconds to get the block, the copy's GB/s, and both as ratios to torch pinned.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.peers import copy_seconds
from roles.device import TOUCH_THREADS, HostBlock


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _copy_rate(dev: torch.Tensor, host: torch.Tensor) -> float:
    return dev.numel() / copy_seconds(host, dev) / 1e9


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    args = parser.parse_args(argv)
    n = int(args.gib * (1 << 30))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = []

    pinned, s = _timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    rows.append(("torch pinned", s, _copy_rate(dev, pinned)))
    del pinned
    block, s = _timed(lambda: HostBlock([n], pin=True, touch=False))
    rows.append(("host block", s, _copy_rate(dev, block.views[0])))
    block.free()
    block, s = _timed(lambda: HostBlock([n], pin=True, touch=True))
    rows.append(("host block, touched first", s, _copy_rate(dev, block.views[0])))
    block.free()

    base_s, base_rate = rows[0][1], rows[0][2]
    print(f"{args.gib:g} GiB, torch intra-op threads {torch.get_num_threads()}, touch threads {TOUCH_THREADS}")
    print(f"{'block':<28}{'get s':>8}{'vs torch':>10}{'D2H GB/s':>10}{'vs torch':>10}")
    for name, s, rate in rows:
        print(f"{name:<28}{s:>8.2f}{s / base_s:>9.2f}x{rate:>10.1f}{rate / base_rate:>9.2f}x")


if __name__ == "__main__":
    main()
