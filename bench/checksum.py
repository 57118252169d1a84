"""What a checkpoint manifest's checksum costs (ppo.state.manifest), and what the alternatives would.

    python -m bench.checksum [--mib 1024] [--repeat 3]

Writes a file of random bytes, reads it back (page cache) in 16 MiB blocks with each
checksum the standard library offers, and prints the best of `--repeat` rates in GB/s and the
time extrapolated to a Qwen3-4B run checkpoint: 8 GB of bf16 weights plus ~48 GB of fp32
master weights and Adam moments (one thread; ppo.state.manifest spreads files over threads).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib

BLOCK = 16 << 20
QWEN3_4B_BYTES = 56e9  # 8 GB weights + 48 GB optimizer state


def _read(path: str, update) -> float:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            update(view[:n])
    return time.perf_counter() - t


def rates(path: str, repeat: int) -> dict[str, float]:
    size = os.path.getsize(path)

    def crc32():
        state = [0]
        return lambda b: state.__setitem__(0, zlib.crc32(b, state[0]))

    makers = {"read only": lambda: (lambda b: None), "zlib.crc32": crc32,
              "blake2b": lambda: hashlib.blake2b(digest_size=16).update, "sha256": lambda: hashlib.sha256().update}
    return {name: max(size / _read(path, make()) / 1e9 for _ in range(repeat)) for name, make in makers.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "blob")
        with open(path, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        found = rates(path, args.repeat)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.mib} MiB, best of {args.repeat}")
    print("| checksum | GB/s (one thread) | Qwen3-4B checkpoint, 56 GB (s) |")
    print("|---|---:|---:|")
    for name, rate in found.items():
        print(f"| {name} | {rate:.2f} | {QWEN3_4B_BYTES / 1e9 / rate:.0f} |")


if __name__ == "__main__":
    main()
