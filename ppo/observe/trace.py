"""The phase trace: RUN_DIR/trace.json in the Chrome trace format (open it in Perfetto,
ui.perfetto.dev, or chrome://tracing), built from the run's event log.

Tracks: `driver` (the steps and phases of each PPO iteration; a `rewind` instant where a
trainer recovery abandons the step under way, ppo.recovery), one per role (`state`: the
lifecycle from its `state` events, with spawns, deaths, restarts and hangs as instants;
`phases`: what the role did, e.g. offload/onload with bytes, weight-sync buckets) and one
per GPU (`lease`: who holds it, released with the bytes left; a `bytes in use` counter by
holder).

The source of truth is RUN_DIR/events.jsonl (runtime.events). `phase` events carry the spans:

    phase  phase (name), action (begin | end | span), track ("driver" or a role; a role's own
           events default to it), step; `end` and `span` carry seconds, `span` t0 (unix start);
           optional gpus + bytes_in_use (the track's bytes on each of those GPUs afterwards)

`TraceWriter` tails the log while the job runs and appends to trace.json as events arrive,
so a crashed run leaves a trace that lacks only its closing `]` (which the format allows);
`python -m ppo.observe.trace RUN_DIR` rebuilds trace.json from the log at any time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from runtime.events import EVENTS_FILE

TRACE_FILE = "trace.json"
_ROLE, _GPU = 1000, 2000  # the viewer sorts tracks by index: the driver, the roles, the GPUs
_NODE = 100  # then node 1's GPUs, node 2's, ...


class StepPhases(dict):
    """One rollout's `perf/*_time` seconds, filled by its phases. Each phase is also published
    as `phase` begin/end events (the trace and the monitor) and told to `on_phase`."""

    def __init__(self, step: int, publish: Callable[..., object],
                 on_phase: Callable[[int, str], None] | None = None):
        super().__init__()
        self.step, self._publish, self._on_phase = step, publish, on_phase

    @contextmanager
    def phase(self, name: str, metric: str | None = "perf/{name}_time") -> Iterator[None]:
        """Time the block as phase `name`, adding its seconds to `metric` (None: trace only)."""
        if self._on_phase is not None:
            self._on_phase(self.step, name)
        self._publish("phase", phase=name, action="begin", track="driver", step=self.step)
        t0 = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - t0
            self._publish("phase", phase=name, action="end", track="driver", step=self.step,
                          seconds=round(seconds, 6))
            if metric is not None:
                key = metric.format(name=name)
                self[key] = self.get(key, 0.0) + seconds


class TraceBuilder:
    """Turns events (runtime.events vocabulary plus `phase`) into Chrome trace events."""

    def __init__(self) -> None:
        self._t0: float | None = None
        self._pids: dict[str, int] = {}
        self._tids: dict[tuple[int, str], int] = {}
        self._open: dict[tuple[int, int], int] = {}  # open B spans per thread
        self._state_open: set[str] = set()  # roles whose state span is open
        self._bytes: dict[tuple[int, int], dict[str, int]] = {}  # (node, gpu) -> holder -> bytes in use
        self._groups: dict[str, str] = {}  # a rank ("actor.1") -> its group, whose name holds the leases

    def add(self, event: dict) -> list[dict]:
        if self._t0 is None:
            self._t0 = event["ts"]
        handler = getattr(self, f"_on_{event['event']}", None)
        return handler(event) if handler is not None else []

    def finish(self, ts: float | None = None) -> list[dict]:
        """End every span still open (a run that stopped mid-phase)."""
        if self._t0 is None:
            return []
        us = self._us(ts if ts is not None else time.time())
        out = []
        for (pid, tid), depth in self._open.items():
            out += [{"ph": "E", "pid": pid, "tid": tid, "ts": us}] * depth
        self._open.clear()
        self._state_open.clear()
        return out

    # -- tracks --------------------------------------------------------------------------
    def _us(self, ts: float) -> float:
        return round((ts - self._t0) * 1e6, 1)

    def _track(self, process: str, thread: str, sort: int) -> tuple[tuple[int, int], list[dict]]:
        meta = []
        if process not in self._pids:
            pid = self._pids[process] = len(self._pids) + 1
            meta += [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}},
                     {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": sort}}]
        pid = self._pids[process]
        if (pid, thread) not in self._tids:
            tid = self._tids[pid, thread] = len(self._tids) + 1
            meta.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": thread}})
        return (pid, self._tids[pid, thread]), meta

    def _begin(self, where: tuple[int, int], name: str, ts: float, **args) -> dict:
        self._open[where] = self._open.get(where, 0) + 1
        return {"ph": "B", "name": name, "pid": where[0], "tid": where[1], "ts": self._us(ts), "args": args}

    def _end(self, where: tuple[int, int], ts: float, **args) -> list[dict]:
        if not self._open.get(where):
            return []
        self._open[where] -= 1
        return [{"ph": "E", "pid": where[0], "tid": where[1], "ts": self._us(ts), "args": args}]

    def _instant(self, where: tuple[int, int], name: str, ts: float, **args) -> dict:
        return {"ph": "i", "s": "t", "name": name, "pid": where[0], "tid": where[1], "ts": self._us(ts),
                "args": args}

    def _role(self, role: str, thread: str = "state"):
        return self._track(role, thread, _ROLE + len(self._pids))

    def _driver(self):
        return self._track("driver", "phases", 0)

    def _gpu(self, node: int, gpu: int, thread: str):
        """A GPU's track: node 0's are "gpu G"; another node's (its events carry `node`, and its
        own GPU ids: runtime.agent) are "node N gpu G", sorted after node 0's."""
        name = f"node {node} gpu {gpu}" if node else f"gpu {gpu}"
        return self._track(name, thread, _GPU + _NODE * node + gpu)

    def _counter(self, node: int, gpu: int, ts: float) -> list[dict]:
        (pid, _), meta = self._gpu(node, gpu, "lease")
        return meta + [{"ph": "C", "name": "bytes in use", "pid": pid, "ts": self._us(ts),
                        "args": dict(self._bytes[node, gpu])}]

    def _set_bytes(self, node: int, gpus: list[int], holder: str, nbytes: int, ts: float) -> list[dict]:
        out = []
        for gpu in gpus:
            self._bytes.setdefault((node, gpu), {})[holder] = nbytes
            out += self._counter(node, gpu, ts)
        return out

    # -- events --------------------------------------------------------------------------
    def _state_span(self, role: str, new: str | None, ts: float, **args) -> list[dict]:
        where, out = self._role(role)
        if role in self._state_open:
            out += self._end(where, ts)
            self._state_open.discard(role)
        if new is not None:
            out.append(self._begin(where, new, ts, **args))
            self._state_open.add(role)
        return out

    def _on_spawned(self, e: dict) -> list[dict]:
        if e.get("group"):
            self._groups[e["role"]] = e["group"]
        out = self._state_span(e["role"], "starting", e["ts"], incarnation=e.get("incarnation"), pid=e.get("pid"))
        return out + [self._instant(self._role(e["role"])[0], f"spawned #{e.get('incarnation')}", e["ts"],
                                    gpus=e.get("gpus"), pid=e.get("pid"))]

    def _on_state(self, e: dict) -> list[dict]:
        return self._state_span(e["role"], e["new"], e["ts"])

    def _on_died(self, e: dict) -> list[dict]:
        out = self._state_span(e["role"], None, e["ts"])
        return out + [self._instant(self._role(e["role"])[0], "died", e["ts"], reason=e.get("reason"),
                                    error_file=e.get("error_file"))]

    def _on_stopped(self, e: dict) -> list[dict]:
        return self._state_span(e["role"], None, e["ts"])

    def _on_restarted(self, e: dict) -> list[dict]:
        where, out = self._role(e["role"])
        return out + [self._instant(where, f"restarted #{e.get('incarnation')}", e["ts"],
                                    reason=e.get("reason"), restarts=e.get("restarts"))]

    def _on_hung(self, e: dict) -> list[dict]:
        where, out = self._role(e["role"])
        return out + [self._instant(where, "hung", e["ts"], silent_s=e.get("silent_s"))]

    def _on_failed(self, e: dict) -> list[dict]:
        where, out = self._driver()
        return out + [self._instant(where, "failed", e["ts"], reason=e.get("reason"))]

    def _on_lease(self, e: dict) -> list[dict]:
        node, gpu, holder, budget = e.get("node") or 0, e["gpu"], e["holder"], e.get("budget")
        # a side-by-side GPU has a lease per budget (runtime.memory), each its own span track
        where, out = self._gpu(node, gpu, f"lease: {budget} budget" if budget else "lease")
        if e["action"] == "acquire":
            out.append(self._begin(where, holder, e["ts"], residuals=e.get("residuals")))
            return out
        if e["action"] == "release":
            out += self._end(where, e["ts"], bytes_left=e.get("bytes_left"))
        return out + self._set_bytes(node, [gpu], holder, e.get("bytes_left") or 0, e["ts"])

    def _on_phase(self, e: dict) -> list[dict]:
        track = e.get("track") or e.get("role") or "driver"
        where, out = (self._driver() if track == "driver"
                      else self._role(track, "phases"))
        name = e["phase"] if e["phase"] != "step" else f"step {e.get('step')}"
        args = {k: v for k, v in e.items() if k not in ("event", "seq", "ts", "phase", "action", "track", "t0")}
        if e["action"] == "begin":
            out.append(self._begin(where, name, e["ts"], **args))
        elif e["action"] == "end":
            out += self._end(where, e["ts"], **args)
        else:  # a span reported once it ended
            t0 = e.get("t0", e["ts"] - e.get("seconds", 0.0))
            out.append({"ph": "X", "name": name, "pid": where[0], "tid": where[1], "ts": self._us(t0),
                        "dur": round(e.get("seconds", 0.0) * 1e6, 1), "args": args})
        if e.get("gpus") and e.get("bytes_in_use") is not None:
            out += self._set_bytes(e.get("node") or 0, e["gpus"], self._groups.get(track, track), e["bytes_in_use"],
                                   e["ts"])
        return out

    def _on_checkpoint(self, e: dict) -> list[dict]:  # published when a save is done
        where, out = self._driver()
        return out + [self._instant(where, f"checkpoint {e.get('step')}", e["ts"], save=e.get("save"),
                                    save_hf=e.get("save_hf"))]

    def _on_rewind(self, e: dict) -> list[dict]:  # ppo.recovery: the step under way is abandoned
        where, out = self._driver()
        while self._open.get(where):
            out += self._end(where, e["ts"], abandoned=True)
        return out + [self._instant(where, f"rewind to step {e.get('to_step')}", e["ts"], **{
            k: e.get(k) for k in ("from_step", "to_step", "checkpoint", "role", "reason", "trainer_restarts")})]

    def _on_metrics(self, e: dict) -> list[dict]:
        (pid, _), out = self._driver()
        reward = (e.get("metrics") or {}).get("rollout/raw_reward")
        if reward is None:
            return out
        return out + [{"ph": "C", "name": "reward", "pid": pid, "ts": self._us(e["ts"]), "args": {"reward": reward}}]

    def _on_shutdown(self, e: dict) -> list[dict]:
        where, out = self._driver()
        return self.finish(e["ts"]) + out + [self._instant(where, "shutdown", e["ts"], reason=e.get("reason"))]


class _TraceFile:
    """trace.json as a JSON array written one event at a time: `[` e1 `,` e2 ... `]`."""

    def __init__(self, path: Path):
        _keep_previous(path)
        self._f = open(path, "w")
        self._f.write("[")
        self._first = True

    def write(self, events: list[dict]) -> None:
        for ev in events:
            self._f.write(("\n" if self._first else ",\n") + json.dumps(ev, default=str))
            self._first = False
        self._f.flush()

    def close(self) -> None:
        self._f.write("\n]\n")
        self._f.close()


class TraceWriter:
    """Follow RUN_DIR/events.jsonl in a thread and append to RUN_DIR/trace.json as events
    arrive (within `poll_s`). `close()` drains the log and ends the array."""

    def __init__(self, run_dir: str | Path, *, poll_s: float = 0.5):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / TRACE_FILE
        self._builder = TraceBuilder()
        self._file = _TraceFile(self.path)
        self._offset = 0
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="tandem-trace", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._drain()
        self._file.write(self._builder.finish())
        self._file.close()

    def _follow(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._drain()

    def _drain(self) -> None:
        try:
            with open(self.run_dir / EVENTS_FILE, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a line without its newline is still being written
        self._offset += end
        for line in data[:end].splitlines():
            if line.strip():
                self._file.write(self._builder.add(json.loads(line)))


def build_trace(run_dir: str | Path) -> Path:
    """Write RUN_DIR/trace.json from the whole event log (e.g. after a killed run)."""
    run_dir = Path(run_dir)
    log = run_dir / EVENTS_FILE
    if not log.exists():
        raise FileNotFoundError(f"{log} does not exist: is {run_dir} a Tandem run dir?")
    builder, out = TraceBuilder(), _TraceFile(run_dir / TRACE_FILE)
    last_ts = None
    for line in log.read_text().splitlines():
        if line.strip() and line.endswith("}"):
            event = json.loads(line)
            last_ts = event["ts"]
            out.write(builder.add(event))
    out.write(builder.finish(last_ts))
    out.close()
    return run_dir / TRACE_FILE


def read_trace(path: str | Path) -> list[dict]:
    """The events of a trace file, also of one a crash left without its closing bracket."""
    text = Path(path).read_text().rstrip()
    return json.loads(text if text.endswith("]") else text + "]")


def _keep_previous(path: Path) -> None:
    """A resumed run keeps the previous trace as trace.<k>.json (as events.<k>.jsonl)."""
    if not path.exists():
        return
    k = 1
    while path.with_name(f"trace.{k}.json").exists():
        k += 1
    path.rename(path.with_name(f"trace.{k}.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppo.observe.trace", description="Rebuild RUN_DIR/trace.json "
                                 "from RUN_DIR/events.jsonl (Chrome trace format; open it in ui.perfetto.dev).")
    ap.add_argument("run_dir", type=Path)
    args = ap.parse_args(argv)
    try:
        print(build_trace(args.run_dir))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
