"""Tool sandbox benchmark: what a tool call costs under bubblewrap and without it.

    python -m bench.tools_sandbox [--calls 20] [--burst 40] [--workers 2]

With the calculator tool (roles/tools/calculator.py), for each mode (bwrap, then the
fallback without it):

  one call    median and fastest wall clock of ``--calls`` calls made one after another
  burst       ``--burst`` calls at once on ``--workers`` workers: calls/s
  start       CPU of starting an executor (its workers and the sandboxed load of the function)

Both modes run in the same process one after the other, so a busy machine slows both;
docs/tools.md quotes the newest figures with the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time

from roles.tools import executor as tool_executor
from roles.tools.sandbox import Limits
from roles.tools.specs import load_tools

LIMITS = Limits(timeout_s=10, cpu_seconds=5, memory_bytes=1 << 30, max_processes=32, max_file_bytes=64 << 20,
                max_output_chars=8192)


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(mode: str, *, calls: int, burst: int, workers: int) -> dict:
    choose = tool_executor.choose_bwrap
    if mode == "none":  # the fallback a machine without bwrap gets (its warning is printed)
        tool_executor.choose_bwrap = lambda: (None, "benchmarking the fallback without bwrap")
    try:
        tools = load_tools("roles.tools.calculator:TOOL_SPECS", "roles.tools.calculator:execute_tool")
        before = _children_cpu()
        tool_executor.ToolExecutor(tools, LIMITS, num_workers=workers).close()
        start_cpu = _children_cpu() - before  # the workers are reaped by close(): their CPU is in
        executor = tool_executor.ToolExecutor(tools, LIMITS, num_workers=workers)
        try:
            async def one_by_one() -> list[float]:
                seconds = []
                for i in range(calls):
                    result = await executor.call("calculator", {"expression": f"{i}*{i}+1"})
                    assert result.ok, result
                    seconds.append(result.seconds)
                return seconds

            async def at_once() -> float:
                start = time.monotonic()
                results = await asyncio.gather(*(executor.call("calculator", {"expression": f"{i}+1"})
                                                 for i in range(burst)))
                assert all(r.ok for r in results), results
                return time.monotonic() - start

            seconds = asyncio.run(one_by_one())
            burst_s = asyncio.run(at_once())
        finally:
            executor.close()
    finally:
        tool_executor.choose_bwrap = choose
    return {"mode": mode, "median_ms": 1000 * statistics.median(seconds), "fastest_ms": 1000 * min(seconds),
            "calls_per_s": burst / burst_s, "start_cpu_ms": 1000 * start_cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--burst", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    for mode in ("bwrap", "none"):
        r = measure(mode, calls=args.calls, burst=args.burst, workers=args.workers)
        print(f"{mode:5s}  one call: median {r['median_ms']:.0f} ms, fastest {r['fastest_ms']:.0f} ms;  "
              f"{args.burst} at once on {args.workers} workers: {r['calls_per_s']:.1f} calls/s;  "
              f"executor start: {r['start_cpu_ms']:.0f} ms CPU")


if __name__ == "__main__":
    main()
