"""Page-locked host memory for offload: what the first offload of a tag pays to get it.

    python -m bench.host_pinning [--gib 8] [--resident-gib 48]

Rows, each a fresh block of the same size, then copies into it and out of it:
- torch pinned: torch.empty(pin_memory=True) (cudaHostAlloc, rounded up to a power of two);
- host block: roles.device.HostBlock(touch=False) (malloc, then cudaHostRegister, which
  faults every page in on one kernel thread);
- host block, touched first: the same after writing every page from
  roles.device.TOUCH_THREADS threads; run with OMP_NUM_THREADS=1, as the role processes are,
  to check it does not rely on torch's intra-op threads;
- host block, pages placed: HostBlock's default (what the trainers' offload and the rollout
  engine use), the same with the pages asked from the GPU's NUMA node first and as
  transparent huge pages (roles.host_pages).
Each row prints seconds to get the block, the warm copies' GB/s each way (best of 3), all as
ratios to torch pinned, the GB/s of the block's first copy each way (cold, as an offload
writes it and an onload reads it), and the NUMA nodes its pages landed on (from
/proc/self/numa_maps) with their share in huge pages (/proc/self/smaps).

--resident-gib N first makes and keeps a touched block of N GiB, as a trainer's optimizer
block is there when its params' block is made: on a host of several NUMA nodes the later
block's pages may land on a node far from the GPU, and the copy from it slows down.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import re
import time

import torch

from bench.peers import copy_seconds
from roles.device import TOUCH_THREADS, HostBlock
from roles.host_pages import gpu_node


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _copy_rates(dev: torch.Tensor, host: torch.Tensor) -> tuple[float, float, float, float]:
    """GB/s of the block's first device->host copy and first host->device copy (an offload
    writes a block once, its onload reads it once), then the best warm copy each way."""
    def once(dst: torch.Tensor, src: torch.Tensor) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return dev.numel() / (time.perf_counter() - t0) / 1e9

    first = once(host, dev), once(dev, host)
    return *first, dev.numel() / copy_seconds(host, dev) / 1e9, dev.numel() / copy_seconds(dev, host) / 1e9


def numa_pages(address: int) -> str:
    """'N0=… N1=…': pages per NUMA node of the mapping that holds `address` ('?' if unknown)."""
    try:
        with open("/proc/self/numa_maps") as f:
            # lines are sorted by start address: the holder is the last one starting at or below it
            holder = [fields for fields in map(str.split, f) if int(fields[0], 16) <= address][-1]
    except (OSError, ValueError, IndexError):
        return "?"
    return " ".join(x for x in holder if x[:1] == "N" and x[1:2].isdigit()) or "?"


def smaps_entry(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping that holds `address` (sizes in kB, and
    VmFlags: "hg" once madvise(MADV_HUGEPAGE) marked it); None if unknown."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, _, end = block.split(" ", 1)[0].partition("-")
        if int(start, 16) <= address < int(end, 16):
            return dict(re.findall(r"^(\w+):\s+(.*?)(?: kB)?$", block, re.M))
    return None


def huge_page_share(address: int) -> float | None:
    """AnonHugePages / Rss of the mapping that holds `address` (/proc/self/smaps); None if unknown."""
    entry = smaps_entry(address)
    if not entry or not int(entry.get("Rss", 0)):
        return None
    return int(entry.get("AnonHugePages", 0)) / int(entry["Rss"])


def _row(name: str, dev: torch.Tensor, make) -> tuple:
    """(name, seconds to get the block, first D2H, first H2D, warm D2H, warm H2D GB/s, pages) of a
    fresh block."""
    block, s = _timed(make)
    host = block.views[0] if isinstance(block, HostBlock) else block
    share = huge_page_share(host.data_ptr())
    pages = numa_pages(host.data_ptr()) + ("" if share is None else f", {share:.0%} in huge pages")
    row = (name, s, *_copy_rates(dev, host), pages)
    if isinstance(block, HostBlock):
        block.free()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--resident-gib", type=float, default=0.0)
    args = parser.parse_args(argv)
    n = int(args.gib * (1 << 30))
    resident = HostBlock([int(args.resident_gib * (1 << 30))], pin=True) if args.resident_gib else None
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    rows = [_row("torch pinned", dev, lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True)),
            _row("host block", dev, lambda: HostBlock([n], pin=True, touch=False, place_pages=False)),
            _row("host block, touched first", dev, lambda: HostBlock([n], pin=True, place_pages=False)),
            _row("host block, pages placed", dev, lambda: HostBlock([n], pin=True))]
    base_s, base_d2h, base_h2d = rows[0][1], rows[0][4], rows[0][5]
    print(f"{args.gib:g} GiB, torch intra-op threads {torch.get_num_threads()}, touch threads {TOUCH_THREADS}, "
          f"GPU's NUMA node {gpu_node()}, resident block {args.resident_gib:g} GiB"
          + (f" (pages {numa_pages(resident.views[0].data_ptr())})" if resident else ""))
    print(f"{'block':<28}{'get s':>8}{'vs torch':>10}{'D2H GB/s':>10}{'vs torch':>10}{'H2D GB/s':>10}{'vs torch':>10}"
          f"{'1st D2H':>9}{'1st H2D':>9}  pages per NUMA node")
    for name, s, first_d2h, first_h2d, d2h, h2d, nodes in rows:
        print(f"{name:<28}{s:>8.2f}{s / base_s:>9.2f}x{d2h:>10.1f}{d2h / base_d2h:>9.2f}x{h2d:>10.1f}"
              f"{h2d / base_h2d:>9.2f}x{first_d2h:>9.1f}{first_h2d:>9.1f}  {nodes}")


if __name__ == "__main__":
    main()
