"""Round trip of a blocking call whose argument is small: a dict against small arrays.

    python -m bench.small_args [--rounds N]

An `echo` endpoint returns its argument. Per argument, blocks of 200 calls (after 50 warm-up
calls) with the arguments taking turns, so a change in machine load hits every row; each
row gives the median and the minimum over the blocks of the block's p50. Small arrays ride
in the message header (runtime.wire, inline_max_bytes), so the gap to the dict row is the
cost of the arrays' encoding and decoding alone.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from runtime import Actor, Supervisor, endpoint


class Echo(Actor):
    @endpoint
    def echo(self, x):
        return x


def main(argv=None) -> dict[str, tuple[float, float]]:
    ap = argparse.ArgumentParser(prog="python -m bench.small_args", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    payloads = {"dict {step, tag}": {"step": 7, "tag": "ping"}, "numpy f64[4]": np.arange(4.0),
                "torch f32[4]": torch.arange(4.0), "numpy 8 KiB": np.zeros(1024)}
    p50: dict[str, list[float]] = {k: [] for k in payloads}
    with tempfile.TemporaryDirectory(prefix="tdm-small-") as d, Supervisor(d) as sup:
        echo = sup.spawn("echo", Echo)
        sup.wait_ready()
        for _ in range(args.rounds):
            for name, payload in payloads.items():
                times = []
                for i in range(250):
                    t0 = time.perf_counter_ns()
                    echo.echo(payload)
                    if i >= 50:
                        times.append((time.perf_counter_ns() - t0) / 1000)
                p50[name].append(statistics.median(times))
    rows = {k: (statistics.median(v), min(v)) for k, v in p50.items()}
    for name, (median, best) in rows.items():
        print(f"{name:18s} p50 {median:5.0f} us (median over blocks), {best:5.0f} us (best block)")
    return rows


if __name__ == "__main__":
    main()
