"""What a small round trip costs below Tandem: bare transports, no runtime.

    python -m bench.transport_floor [--calls N]

A client process pings an echo process with a 100-byte message and waits for it back,
after a warm-up; p50/p99 per setup, and each p50 as a ratio of the first row's:

  zmq, sleeping    pyzmq DEALER -> ROUTER over ipc, both sides block in recv
  zmq, polling     the same, the client polls (yielding the CPU) instead of sleeping,
                   as Tandem's callers and actors do for up to spin_us
  zmq, one CPU     sleeping, both processes pinned to CPU 0: no cross-CPU wake-ups
  unix socket      a plain AF_UNIX stream socket: one thread per side, no I/O threads

The gap between the first and third rows is what waking threads on other CPUs costs;
the last row is the floor without libzmq's I/O threads.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import tempfile
import time

import numpy as np

MESSAGE = b"x" * 100


def _zmq_echo(endpoint: str, cpu: int | None) -> None:
    import zmq

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        ident, msg = sock.recv_multipart()
        if msg == b"stop":
            return
        sock.send_multipart([ident, msg])


def _unix_echo(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    while (msg := conn.recv(65536)) != b"stop":
        conn.sendall(msg)


def _time_calls(ping, calls: int) -> np.ndarray:
    for _ in range(calls // 10):
        ping()
    out = np.empty(calls)
    for i in range(calls):
        t0 = time.perf_counter_ns()
        ping()
        out[i] = time.perf_counter_ns() - t0
    return out / 1e3


def zmq_round_trips(calls: int, poll: bool, cpu: int | None) -> np.ndarray:
    import zmq

    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{d}/echo.sock"
        proc = multiprocessing.get_context("spawn").Process(target=_zmq_echo, args=(endpoint, cpu))
        proc.start()
        before = os.sched_getaffinity(0)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)

        def ping():
            sock.send(MESSAGE)
            if poll:
                while not sock.poll(0):
                    os.sched_yield()
            sock.recv()
        try:
            return _time_calls(ping, calls)
        finally:
            sock.send(b"stop")
            proc.join(10)
            ctx.destroy(linger=0)
            os.sched_setaffinity(0, before)


def unix_round_trips(calls: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/echo.sock"
        proc = multiprocessing.get_context("spawn").Process(target=_unix_echo, args=(path,))
        proc.start()
        conn = socket.socket(socket.AF_UNIX)
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

        def ping():
            conn.sendall(MESSAGE)
            conn.recv(65536)
        try:
            return _time_calls(ping, calls)
        finally:
            conn.sendall(b"stop")
            proc.join(10)
            conn.close()


def run(calls: int) -> dict[str, np.ndarray]:
    return {"zmq, sleeping": zmq_round_trips(calls, poll=False, cpu=None),
            "zmq, polling": zmq_round_trips(calls, poll=True, cpu=None),
            "zmq, one CPU": zmq_round_trips(calls, poll=False, cpu=0),
            "unix socket": unix_round_trips(calls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transport_floor", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000, help="timed round trips per setup (default 3000)")
    args = parser.parse_args(argv)
    if args.calls < 10:
        parser.error(f"--calls {args.calls}: must be at least 10")
    from rich.console import Console
    from rich.table import Table

    results = run(args.calls)
    base = float(np.percentile(results["zmq, sleeping"], 50))
    table = Table(title=f"round trip of a {len(MESSAGE)}-byte message, {args.calls} calls, {os.cpu_count()} CPUs")
    for col in ("setup", "p50 (us)", "p99 (us)", "p50 / zmq sleeping"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    for name, us in results.items():
        p50, p99 = np.percentile(us, [50, 99])
        table.add_row(name, f"{p50:.0f}", f"{p99:.0f}", f"{p50 / base:.2f}x")
    Console().print(table)
    return 0


if __name__ == "__main__":
    from bench.transport_floor import main as _main  # spawned children unpickle bench.transport_floor.X

    raise SystemExit(_main())
