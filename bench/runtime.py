"""Runtime benchmark: Tandem actors against Ray actors and a plain multiprocessing worker.

    python -m bench.runtime [--json FILE] [--quick] [--peers tandem,ray,mp]

Four measurements, every one in a fresh process of its own and one at a time, so a
peer's daemons (Ray's raylet and GCS, Tandem's role processes) are gone before the
next peer starts:

  round trip  p50/p99 of a blocking call to a no-op endpoint that returns its small
              argument, after a warm-up
  transfer    a plain numpy uint8 array of 1, 64 and 256 MiB sent to the actor, which
              returns ``a.nbytes``; GB/s (1e9 bytes/s) of the median call after warm-up.
              Every peer copies the bytes at least once, so one memcpy in one process
              (measured first, reported beside the table) bounds these rows.
  shared      the same arrays placed in shared memory once, before timing, the way each
              peer offers: Tandem ``shared_empty``, Ray ``ray.put`` (the actor gets the
              ObjectRef's value), multiprocessing ``shared_memory.SharedMemory`` (the
              worker attaches by name); then sent as above, with nothing copied
  spawn       start the runtime (``Supervisor()``, ``ray.init()``, nothing for mp) and
              8 actors, and get a first reply from each; median over fresh processes,
              the peers taking turns so that a change in machine load hits all of them

The peers run the same ``Sink`` class: Tandem with its defaults; Ray with its defaults
but no dashboard and no log forwarding (both only make Ray slower); multiprocessing as
one spawn Process per actor serving a request Queue / response Queue pair, which is
what plain stdlib code would do. The targets are ratios against Ray measured in the
same run, so a busy machine slows both sides of each ratio.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

PEERS = ("tandem", "ray", "mp")
SMALL_ARG = {"step": 7, "tag": "ping"}  # a control-sized call: msgpack/pickle of a few bytes
WORKER_TIMEOUT_S = 300.0


@dataclass(frozen=True, kw_only=True)
class Plan:
    num_calls: int
    num_warmup_calls: int
    num_transfers: int
    num_warmup_transfers: int
    num_spawns: int  # fresh processes per peer for the spawn time
    num_actors: int = 8
    transfer_bytes: tuple[int, ...] = (1 << 20, 64 << 20, 256 << 20)


# Ray's object store reaches its speed only after a few transfers of a size, and then still
# stalls now and then: three warm-ups, and a median of 15.
FULL = Plan(num_calls=3000, num_warmup_calls=300, num_transfers=15, num_warmup_transfers=3, num_spawns=3)
QUICK = Plan(num_calls=200, num_warmup_calls=20, num_transfers=3, num_warmup_transfers=1, num_spawns=1)


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    higher_is_better: bool
    fmt: str


def _size_label(nbytes: int) -> str:
    return f"{nbytes >> 20}MiB"


def metrics_of(plan: Plan) -> list[Metric]:
    return [Metric("round_trip_p50_us", "round trip p50 (us)", False, "{:.0f}"),
            Metric("round_trip_p99_us", "round trip p99 (us)", False, "{:.0f}"),
            *[Metric(f"transfer_{_size_label(n)}_gbps", f"{n >> 20} MiB transfer (GB/s)", True, "{:.2f}")
              for n in plan.transfer_bytes],
            *[Metric(f"shared_{_size_label(n)}_gbps", f"{n >> 20} MiB shared array (GB/s)", True, "{:.1f}")
              for n in plan.transfer_bytes],
            Metric(f"spawn_{plan.num_actors}_s", f"spawn {plan.num_actors} actors (s)", False, "{:.2f}")]


@dataclass(frozen=True)
class Target:
    """Tandem's value / Ray's for metric ``key``: at most ``bound`` when lower is better,
    at least ``bound`` when higher is better."""

    name: str
    key: str
    bound: float


TARGETS = (Target("round-trip p50 at most 1/5 of Ray's", "round_trip_p50_us", 1 / 5),
           Target("64 MiB transfer at least 2x Ray's GB/s", "transfer_64MiB_gbps", 2.0),
           Target("256 MiB transfer at least 2x Ray's GB/s", "transfer_256MiB_gbps", 2.0),
           Target("64 MiB shared array at least 2x Ray's GB/s", "shared_64MiB_gbps", 2.0),
           Target("256 MiB shared array at least 2x Ray's GB/s", "shared_256MiB_gbps", 2.0),
           Target("spawning 8 actors at most 1/2 of Ray's time", "spawn_8_s", 1 / 2))


# -- the actor every peer runs ---------------------------------------------------------

class Sink:
    """The benchmarked actor: a no-op that echoes small arguments and sizes big ones."""

    def echo(self, x):
        return x

    def nbytes(self, a):
        return a.nbytes


def __getattr__(name: str):
    # TandemSink is built on first use because the multiprocessing and Ray workers import
    # this module too: they must not pay for importing Tandem's runtime (zmq, msgpack,
    # psutil), or the spawn times would not compare like with like.
    if name != "TandemSink":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from runtime import Actor, endpoint

    for method in ("echo", "nbytes"):
        endpoint(getattr(Sink, method))
    cls = type("TandemSink", (Sink, Actor), {"__module__": __name__})
    globals()[name] = cls  # pickle finds the class by name; it must be this same object
    return cls


# -- the peers -----------------------------------------------------------------------
# Each peer: start(num_actors) starts its runtime and actors; call(method, arg) calls
# actor 0 and waits; call_all(method, arg) calls every actor at once and waits for all.

class _TandemPeer:
    def __init__(self):
        from runtime import Supervisor, gather

        self._supervisor_cls, self._gather = Supervisor, gather
        self._cls = sys.modules[__name__].TandemSink
        self._run_dir = tempfile.mkdtemp(prefix="tandem-bench-")
        self._sup = None
        self._actors: list = []

    def start(self, num_actors: int) -> None:
        self._sup = self._supervisor_cls(self._run_dir)
        self._actors = [self._sup.spawn(f"sink{i}", self._cls) for i in range(num_actors)]

    def call(self, method: str, arg: Any) -> Any:
        return getattr(self._actors[0], method)(arg)

    def call_all(self, method: str, arg: Any) -> list:
        return self._gather([getattr(a, method).call(arg) for a in self._actors])

    def share(self, array: np.ndarray):
        from runtime import shared_empty

        shared = shared_empty(array.shape, array.dtype)
        shared[...] = array
        return shared

    def call_shared(self, method: str, shared) -> Any:
        return self.call(method, shared)

    def unshare(self, shared) -> None:
        pass

    def close(self) -> None:
        if self._sup is not None:
            self._sup.shutdown()
        shutil.rmtree(self._run_dir, ignore_errors=True)


class _RayPeer:
    def __init__(self):
        import ray

        self._ray = ray
        self._actors: list = []

    def start(self, num_actors: int) -> None:
        self._ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        cls = self._ray.remote(Sink)
        self._actors = [cls.remote() for _ in range(num_actors)]

    def call(self, method: str, arg: Any) -> Any:
        return self._ray.get(getattr(self._actors[0], method).remote(arg))

    def call_all(self, method: str, arg: Any) -> list:
        return self._ray.get([getattr(a, method).remote(arg) for a in self._actors])

    def share(self, array: np.ndarray):
        return self._ray.put(array)

    def call_shared(self, method: str, ref) -> Any:
        return self.call(method, ref)  # Ray hands the actor the object's value, zero-copy

    def unshare(self, ref) -> None:
        del ref

    def close(self) -> None:
        self._ray.shutdown()


def _mp_serve(requests, responses) -> None:
    from multiprocessing import shared_memory

    sink = Sink()
    for method, arg in iter(requests.get, None):
        if isinstance(arg, _SharedRef):  # attach by name, as stdlib code would
            block = shared_memory.SharedMemory(arg.name)
            array = np.ndarray(arg.shape, arg.dtype, buffer=block.buf)
            responses.put(getattr(sink, method)(array))
            del array
            block.close()
        else:
            responses.put(getattr(sink, method)(arg))


@dataclass(frozen=True)
class _SharedRef:
    name: str
    shape: tuple
    dtype: str


class _MultiprocessingPeer:
    def __init__(self):
        self._ctx = multiprocessing.get_context("spawn")
        self._queues: list[tuple] = []
        self._procs: list = []

    def start(self, num_actors: int) -> None:
        self._queues = [(self._ctx.Queue(), self._ctx.Queue()) for _ in range(num_actors)]
        self._procs = [self._ctx.Process(target=_mp_serve, args=q, daemon=True) for q in self._queues]
        for p in self._procs:
            p.start()

    def call(self, method: str, arg: Any) -> Any:
        requests, responses = self._queues[0]
        requests.put((method, arg))
        return responses.get()

    def call_all(self, method: str, arg: Any) -> list:
        for requests, _ in self._queues:
            requests.put((method, arg))
        return [responses.get() for _, responses in self._queues]

    def share(self, array: np.ndarray):
        from multiprocessing import shared_memory

        block = shared_memory.SharedMemory(create=True, size=array.nbytes)
        np.ndarray(array.shape, array.dtype, buffer=block.buf)[...] = array
        return block, _SharedRef(block.name, array.shape, array.dtype.str)

    def call_shared(self, method: str, shared) -> Any:
        return self.call(method, shared[1])

    def unshare(self, shared) -> None:
        shared[0].close()
        shared[0].unlink()

    def close(self) -> None:
        for requests, _ in self._queues:
            requests.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.exitcode is None:
                p.kill()
                p.join()
        for requests, responses in self._queues:
            for q in (requests, responses):
                q.close()
                q.join_thread()


_PEER_CLASSES = {"tandem": _TandemPeer, "ray": _RayPeer, "mp": _MultiprocessingPeer}


# -- measurements (each runs inside a fresh worker process) ------------------------------

def _measure_spawn(peer, plan: Plan) -> dict:
    start = time.perf_counter()
    try:
        peer.start(plan.num_actors)
        replies = peer.call_all("echo", SMALL_ARG)
        elapsed = time.perf_counter() - start
    finally:
        peer.close()
    if replies != [SMALL_ARG] * plan.num_actors:
        raise RuntimeError(f"first replies were {replies!r}, expected {SMALL_ARG!r} from each actor")
    return {"spawn_s": elapsed}


def _measure_calls(peer, plan: Plan) -> dict:
    peer.start(1)
    try:
        if peer.call("echo", SMALL_ARG) != SMALL_ARG:
            raise RuntimeError("the echo endpoint did not return its argument")
        for _ in range(plan.num_warmup_calls):
            peer.call("echo", SMALL_ARG)
        round_trips_ns = []
        for _ in range(plan.num_calls):
            t0 = time.perf_counter_ns()
            peer.call("echo", SMALL_ARG)
            round_trips_ns.append(time.perf_counter_ns() - t0)
        transfers, shared = {}, {}
        for nbytes in plan.transfer_bytes:
            array = np.ones(nbytes, dtype=np.uint8)  # pages touched: the sender's faults are not timed
            transfers[_size_label(nbytes)] = _rates(lambda: peer.call("nbytes", array), nbytes, plan)
            placed = peer.share(array)
            shared[_size_label(nbytes)] = _rates(lambda: peer.call_shared("nbytes", placed), nbytes, plan)
            peer.unshare(placed)
    finally:
        peer.close()
    p50, p99 = np.percentile(np.array(round_trips_ns) / 1e3, [50, 99])
    return {"round_trip_p50_us": float(p50), "round_trip_p99_us": float(p99),
            "transfer_gbps": transfers, "shared_gbps": shared}


def _rates(send: Callable[[], Any], nbytes: int, plan: Plan) -> list[float]:
    """GB/s of each timed call of ``send`` (which must return nbytes), after the warm-up."""
    rates = []
    for i in range(plan.num_warmup_transfers + plan.num_transfers):
        t0 = time.perf_counter()
        got = send()
        seconds = time.perf_counter() - t0
        if got != nbytes:
            raise RuntimeError(f"nbytes returned {got} for an array of {nbytes} bytes")
        if i >= plan.num_warmup_transfers:
            rates.append(nbytes / seconds / 1e9)
    return rates


def memcpy_gbps(plan: Plan) -> dict[str, float]:
    """One copy between two pre-faulted arrays in one process, median GB/s per size: the
    most a transfer that copies once can reach on this machine."""
    out = {}
    for nbytes in plan.transfer_bytes:
        src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
        out[_size_label(nbytes)] = statistics.median(
            _rates(lambda: np.copyto(dst, src) or nbytes, nbytes, plan))
    return out


def _worker(peer_name: str, job: str, plan: Plan, conn) -> None:
    """Entry point of a fresh process: measure one job of one peer, send the result back."""
    try:
        peer = _PEER_CLASSES[peer_name]()
        result = (_measure_spawn if job == "spawn" else _measure_calls)(peer, plan)
        result["leftover_processes"] = _reap_descendants()
        conn.send(("ok", result))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _reap_descendants(grace_s: float = 10.0) -> int:
    """Wait for this process's descendants to end (a runtime's daemons may take a moment
    after shutdown), SIGKILL what is left; returns how many had to be killed."""
    import psutil

    deadline = time.monotonic() + grace_s
    while True:
        left = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(p.cmdline()):
                    left.append(p)
            except psutil.Error:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    return len(left)


def _in_fresh_process(peer_name: str, job: str, plan: Plan) -> dict:
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_worker, args=(peer_name, job, plan, sender), name=f"bench-{peer_name}-{job}")
    proc.start()
    sender.close()
    try:
        if not receiver.poll(WORKER_TIMEOUT_S):
            proc.kill()
            raise TimeoutError(f"{peer_name} {job}: no result within {WORKER_TIMEOUT_S:.0f} s")
        status, payload = receiver.recv()
    except EOFError:
        proc.join(timeout=10)
        raise RuntimeError(f"{peer_name} {job}: the worker process died (exit code {proc.exitcode})") from None
    finally:
        proc.join(timeout=30)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
        receiver.close()
    if status != "ok":
        raise RuntimeError(f"{peer_name} {job} failed in its worker process:\n{payload}")
    return payload


# -- the run ---------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    import psutil

    versions = {}
    for package in ("pyzmq", "msgpack", "numpy", "ray"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"cpus": os.cpu_count(), "cpu_model": _cpu_model(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "load_average_start": [round(x, 2) for x in os.getloadavg()],
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


def run(peers: Sequence[str] = PEERS, *, quick: bool = False,
        progress: Callable[[str], None] = lambda message: None) -> dict:
    """Measure the peers one after another; returns every number (see ``main`` for the table)."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise ValueError(f"peers={list(peers)!r}: allowed values are {', '.join(PEERS)} (at least one)")
    plan = QUICK if quick else FULL
    results: dict = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                     "quick": quick, "plan": asdict(plan), "machine": machine_info(), "peers": {}}
    progress("memcpy in this process")
    results["memcpy_gbps"] = memcpy_gbps(plan)
    measured = []
    for name in peers:
        if name == "ray" and importlib.util.find_spec("ray") is None:
            results["peers"][name] = {"skipped": "ray is not importable (pip install 'tandem[bench]')"}
        else:
            measured.append(name)
    spawns: dict[str, list[float]] = {name: [] for name in measured}
    leftovers = {name: 0 for name in measured}
    for i in range(plan.num_spawns):
        for name in measured:  # peers take turns, so a load change hits every peer
            progress(f"{name}: spawn {plan.num_actors} actors ({i + 1}/{plan.num_spawns})")
            out = _in_fresh_process(name, "spawn", plan)
            spawns[name].append(out["spawn_s"])
            leftovers[name] += out["leftover_processes"]
    for name in measured:
        progress(f"{name}: round trips and transfers")
        out = _in_fresh_process(name, "calls", plan)
        leftovers[name] += out["leftover_processes"]
        metrics = {"round_trip_p50_us": out["round_trip_p50_us"], "round_trip_p99_us": out["round_trip_p99_us"]}
        for kind in ("transfer", "shared"):
            for label, rates in out[f"{kind}_gbps"].items():
                metrics[f"{kind}_{label}_gbps"] = statistics.median(rates)
        metrics[f"spawn_{plan.num_actors}_s"] = statistics.median(spawns[name])
        results["peers"][name] = {"metrics": metrics,
                                  "samples": {"transfer_gbps": out["transfer_gbps"],
                                              "shared_gbps": out["shared_gbps"], "spawn_s": spawns[name]},
                                  "leftover_processes_killed": leftovers[name]}
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["ratios"] = _ratios(results, plan)
    results["targets"] = _check_targets(results, plan)
    return results


def _ratios(results: dict, plan: Plan) -> dict:
    """{"tandem/PEER": {metric: tandem value / peer value}} for every measured peer."""
    peers = results["peers"]
    if "metrics" not in peers.get("tandem", {}):
        return {}
    ours = peers["tandem"]["metrics"]
    return {f"tandem/{name}": {m.key: ours[m.key] / peer["metrics"][m.key] for m in metrics_of(plan)}
            for name, peer in peers.items() if name != "tandem" and "metrics" in peer}


def _check_targets(results: dict, plan: Plan) -> list[dict]:
    against_ray = results["ratios"].get("tandem/ray")
    higher_is_better = {m.key: m.higher_is_better for m in metrics_of(plan)}
    checks = []
    for t in TARGETS:
        higher = higher_is_better[t.key]
        ratio = against_ray[t.key] if against_ray else None
        passed = None if ratio is None else (ratio >= t.bound if higher else ratio <= t.bound)
        checks.append({"name": t.name, "metric": t.key, "bound": t.bound, "higher_is_better": higher,
                       "ratio": ratio, "passed": passed})
    return checks


# -- the report --------------------------------------------------------------------------

def render(results: dict):
    """The report as a rich renderable: machine header, table, one PASS/FAIL line per target."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    plan = Plan(**{**results["plan"], "transfer_bytes": tuple(results["plan"]["transfer_bytes"])})
    m = results["machine"]
    header = (f"Tandem runtime benchmark, {results['date']}{' (quick)' if results['quick'] else ''}\n"
              f"machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB, python {m['python']}, "
              + ", ".join(f"{k} {v}" for k, v in m["versions"].items())
              + f"\nload average (1/5/15 min): {' '.join(map(str, m['load_average_start']))} at start, "
              f"{' '.join(map(str, m['load_average_end']))} at end\n"
              f"{plan.num_calls} calls after {plan.num_warmup_calls} warm-up; transfers: median of "
              f"{plan.num_transfers} after {plan.num_warmup_transfers} warm-up; spawn: median of "
              f"{plan.num_spawns} fresh processes")
    peers = results["peers"]
    table = Table()
    table.add_column("metric")
    for name in peers:
        table.add_column(name, justify="right")
    for name in results["ratios"]:
        table.add_column(name, justify="right")
    for metric in metrics_of(plan):
        row = [metric.label + (" ^" if metric.higher_is_better else " v")]
        for peer in peers.values():
            row.append(metric.fmt.format(peer["metrics"][metric.key]) if "metrics" in peer else "skipped")
        row += [f"{ratios[metric.key]:.2f}x" for ratios in results["ratios"].values()]
        table.add_row(*row)
    lines = [Text("^ higher is better, v lower is better; ratio columns are Tandem's value / the peer's"),
             Text("one memcpy in one process (bounds every copied transfer): "
                  + ", ".join(f"{label[:-3]} MiB {gbps:.2f} GB/s" for label, gbps in results["memcpy_gbps"].items()))]
    for name, peer in peers.items():
        if "skipped" in peer:
            lines.append(Text(f"note: {name} skipped: {peer['skipped']}", style="yellow"))
        elif peer["leftover_processes_killed"]:
            lines.append(Text(f"note: {name} left {peer['leftover_processes_killed']} processes behind "
                              "after shutdown; they were killed", style="yellow"))
    for check in results["targets"]:
        if check["passed"] is None:
            lines.append(Text(f"n/a   {check['name']}: Ray was not measured"))
        else:
            verdict, style = ("PASS", "green") if check["passed"] else ("FAIL", "red")
            lines.append(Text.assemble((f"{verdict}  ", style),
                                       f"{check['name']}: {check['ratio']:.2f}x (target "
                                       f"{'>=' if check['higher_is_better'] else '<='} {check['bound']:.2f}x)"))
    return Group(Text(header), table, *lines)


def _parse_peers(text: str) -> list[str]:
    peers = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad or not peers:
        raise argparse.ArgumentTypeError(f"--peers {text!r}: allowed values are {', '.join(PEERS)}, comma-separated")
    return peers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.runtime", description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="also write every number as JSON to FILE")
    parser.add_argument("--quick", action="store_true", help="fewer calls, transfers and spawns (a smoke run)")
    parser.add_argument("--peers", type=_parse_peers, default=list(PEERS),
                        help=f"comma-separated subset of {','.join(PEERS)} (default: all)")
    args = parser.parse_args(argv)
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 120)
    log = Console(stderr=True)
    results = run(args.peers, quick=args.quick, progress=lambda message: log.print(f"[dim]{message}[/dim]"))
    console.print(render(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    # Run the importable module, not __main__: the worker processes then unpickle
    # bench.runtime.X by that name.
    from bench.runtime import main as _main

    sys.exit(_main())
