"""What CURVE over tcp costs against ipc on one box: the control plane between nodes.

    python -m bench.cross_node [--calls N] [--mib M]

The driver calls an echo role under three supervisors and times, after a warm-up:

  ipc              one node as today: ipc sockets, arrays of 1 MiB and more by shared memory
  tcp              tcp on 127.0.0.1, plaintext (no shared memory: as between hosts)
  tcp + CURVE      tcp with the job's key pair on every socket (runtime.curve), as nodes talk

a small call's round trip (p50, p99) and a batch of M MiB sent to the role and back (p50),
each with its ratio to the ipc row. On one box the tcp rows measure the software cost
(copies, encryption), not a network's.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np

from runtime import Actor, Supervisor, endpoint
from runtime.curve import KeyPair

SETUPS = {"ipc": {"transport": "ipc"}, "tcp": {"transport": "tcp"}, "tcp + CURVE": {"transport": "tcp"}}


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


def _times(fn, n: int) -> np.ndarray:
    for _ in range(max(1, n // 10)):
        fn()
    out = np.empty(n)
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out[i] = time.perf_counter_ns() - t0
    return out / 1e3  # us


def measure(setup: str, calls: int, mib: int) -> dict[str, float]:
    keys = KeyPair.new() if setup == "tcp + CURVE" else None
    batch = np.random.default_rng(0).integers(0, 50_000, size=(mib << 20) // 4, dtype=np.int32)  # token ids
    with tempfile.TemporaryDirectory() as d, Supervisor(d, job_keys=keys, **SETUPS[setup]) as sup:
        role = sup.spawn("echo", Echo)
        assert np.array_equal(role.echo(batch), batch), f"{setup}: the batch came back changed"
        small = _times(lambda: role.echo(1), calls)
        big = _times(lambda: role.echo(batch), max(5, calls // 100))
    return {"p50_us": float(np.percentile(small, 50)), "p99_us": float(np.percentile(small, 99)),
            "batch_p50_ms": float(np.percentile(big, 50)) / 1e3}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    ap = argparse.ArgumentParser(prog="python -m bench.cross_node", description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="small calls per setup")
    ap.add_argument("--mib", type=int, default=16, help="the batch's size, sent there and back")
    args = ap.parse_args(argv)
    rows = {s: measure(s, args.calls, args.mib) for s in SETUPS}
    base = rows["ipc"]
    print(f"{'setup':<14}{'call p50 us':>12}{'p99 us':>10}{'ratio':>7}{f'{args.mib} MiB p50 ms':>16}{'ratio':>7}")
    for s, r in rows.items():
        print(f"{s:<14}{r['p50_us']:>12.0f}{r['p99_us']:>10.0f}{r['p50_us'] / base['p50_us']:>7.2f}"
              f"{r['batch_p50_ms']:>16.1f}{r['batch_p50_ms'] / base['batch_p50_ms']:>7.2f}")
    return rows


if __name__ == "__main__":
    main()
