"""Live view of a run: `python -m runtime.monitor RUN_DIR [--json] [--once]`.

Attaches read-only through runtime.events.follow_events, so it can start before, during
or after the job; the table is rebuilt from the whole event history. It exits 0 when the
job ends, 2 when RUN_DIR is not a run dir.

  --json   print each event as one JSON line instead of the table
  --once   show what has been logged so far and exit instead of following
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from runtime.events import SUPERVISOR_FILE, follow_events, read_events
from runtime.units import format_bytes


@dataclass(kw_only=True)
class RoleRow:
    name: str
    node: int | None = None  # a job across nodes: the node the role runs on (runtime.agent)
    incarnation: int = 0
    state: str = "starting"
    gpus: list[int] = field(default_factory=list)
    pid: int | None = None
    rss_bytes: int | None = None
    cpu: float | None = None
    calls_total: int = 0
    calls_per_s: float | None = None  # between the last two role_stats of this incarnation
    errors_total: int = 0
    restarts: int = 0
    last_error: str | None = None
    stats_ts: float | None = None  # ts of the role_stats that calls_total came from


class MonitorState:
    """The table model: a pure reduction of events (see runtime.events for the vocabulary).

    Rates use the events' own timestamps, so replaying a history gives the numbers that
    were shown live.
    """

    def __init__(self) -> None:
        self.roles: dict[str, RoleRow] = {}
        # A GPU is (node, gpu): across nodes each node numbers its own GPUs, and node 0's bus carries
        # the other nodes' lease and phase events with their `node` (runtime.agent); node 0 otherwise.
        # (node, gpu, budget) -> {"holder": str | None, "residuals": {holder: bytes}}; budget "" is a
        # whole GPU's one lease, a side-by-side GPU has one per budget (runtime.memory)
        self.leases: dict[tuple[int, int, str], dict] = {}
        self.gpu_bytes: dict[tuple[int, int], dict[str, int]] = {}  # GPU -> holder -> bytes in use, as last reported
        self.phases: list[dict] = []  # driver phases begun and not ended, outermost first
        self.last_phase: dict | None = None  # the latest phase that ended (begin/end: the driver's)
        self.groups: dict[str, str] = {}  # a rank ("actor.1") -> its group, whose name holds the leases
        self.step: int | None = None
        self.metrics: dict = {}
        self.supervisor_pid: int | None = None
        self.num_rejected = 0
        self.failure: str | None = None  # why the supervisor gave up on the job
        self.last_rejected: str | None = None
        self.ended = False
        self.shutdown_reason: str | None = None
        self.last_seq = 0

    def apply(self, event: dict) -> None:
        self.last_seq = event["seq"]
        handler = getattr(self, f"_on_{event['event']}", None)
        if handler is not None:  # events this view does not show (socket) only advance seq
            handler(event)

    def _row(self, event: dict) -> RoleRow:
        row = self.roles.setdefault(event["role"], RoleRow(name=event["role"]))
        for name in ("incarnation", "pid", "gpus", "node"):
            if event.get(name) is not None:
                setattr(row, name, event[name])
        return row

    def _on_supervisor_started(self, event: dict) -> None:
        self.supervisor_pid = event.get("pid")

    def _on_spawned(self, event: dict) -> None:
        if event.get("group"):
            self.groups[event["role"]] = event["group"]
        row = self._row(event)
        row.state = "starting"
        # A new incarnation starts its counters from zero.
        row.rss_bytes = row.cpu = row.calls_per_s = row.stats_ts = None
        row.calls_total = row.errors_total = 0

    def _on_ready(self, event: dict) -> None:
        self._row(event).state = "ready"

    def _on_state(self, event: dict) -> None:
        self._row(event).state = event["new"]

    def _on_died(self, event: dict) -> None:
        row = self._row(event)
        row.state = "dead"
        row.last_error = event.get("reason")

    def _on_stopped(self, event: dict) -> None:
        self._row(event).state = "stopped"  # a clean shutdown: no error to show

    def _on_restarted(self, event: dict) -> None:
        row = self._row(event)
        row.restarts = event.get("restarts", row.restarts + 1)

    def _on_hung(self, event: dict) -> None:
        row = self._row(event)
        row.state = "hung"
        row.last_error = f"no heartbeat for {event.get('silent_s', 0):.0f} s"

    def _on_role_stats(self, event: dict) -> None:
        for name, stats in event["roles"].items():
            row = self.roles.setdefault(name, RoleRow(name=name))
            calls = stats.get("calls_total", 0)
            if row.stats_ts is not None and event["ts"] > row.stats_ts and calls >= row.calls_total:
                row.calls_per_s = (calls - row.calls_total) / (event["ts"] - row.stats_ts)
            row.calls_total, row.stats_ts = calls, event["ts"]
            row.rss_bytes = stats.get("rss_bytes")
            row.cpu = stats.get("cpu")
            row.errors_total = stats.get("errors_total", 0)

    def _on_lease(self, event: dict) -> None:
        gpu = (event.get("node") or 0, event["gpu"])
        lease = self.leases.setdefault((*gpu, event.get("budget", "")), {"holder": None, "residuals": {}})
        if event["action"] == "acquire":
            lease["holder"] = event["holder"]
        elif event["action"] == "release":
            lease["holder"] = None
        lease["residuals"] = dict(event.get("residuals") or {})
        if event["action"] != "acquire" and event.get("bytes_left") is not None:
            self.gpu_bytes.setdefault(gpu, {})[event["holder"]] = event["bytes_left"]

    def _on_phase(self, event: dict) -> None:
        track = event.get("track") or event.get("role") or "driver"
        if event["action"] == "begin":
            self.phases.append({"name": event["phase"], "track": track, "step": event.get("step"),
                                "ts": event["ts"]})
        elif event["action"] == "end":  # the innermost open phase of that name ends
            for i in range(len(self.phases) - 1, -1, -1):
                if self.phases[i]["name"] == event["phase"] and self.phases[i]["track"] == track:
                    del self.phases[i]
                    break
            self.last_phase = {"name": event["phase"], "track": track, "seconds": event.get("seconds")}
        if event.get("gpus") and event.get("bytes_in_use") is not None:  # a role's span reports its bytes
            for gpu in event["gpus"]:
                key = (event.get("node") or 0, gpu)
                self.gpu_bytes.setdefault(key, {})[self.groups.get(track, track)] = event["bytes_in_use"]

    def _on_metrics(self, event: dict) -> None:
        self.step = event.get("step")
        self.metrics = dict(event.get("metrics") or {})

    def _on_rejected(self, event: dict) -> None:
        self.num_rejected += 1
        self.last_rejected = f"{event.get('role', '?')}: {event.get('reason', '?')}"

    def _on_failed(self, event: dict) -> None:
        self.failure = event.get("reason")

    def _on_shutdown(self, event: dict) -> None:
        self.ended = True
        self.shutdown_reason = event.get("reason")


def render(state: MonitorState, run_dir: str) -> Group:
    status = f"ended ({state.shutdown_reason})" if state.ended else "running"
    table = Table(title=f"{run_dir}: {status}, {state.last_seq} events", title_justify="left")
    nodes = any(row.node is not None for row in state.roles.values())  # a column only across nodes
    for column in ("role", *(("node",) if nodes else ()), "inc", "state", "gpus", "pid", "rss", "calls/s",
                   "errors", "restarts"):
        table.add_column(column, no_wrap=True)
    # The one column that wraps, so the others stay readable on an 80-column terminal.
    table.add_column("last error", overflow="fold", min_width=12, ratio=1)
    for row in state.roles.values():
        table.add_row(
            row.name, *((str(row.node if row.node is not None else 0),) if nodes else ()),
            str(row.incarnation), row.state, ",".join(map(str, row.gpus)) or "-",
            _or_dash(row.pid), format_bytes(row.rss_bytes) if row.rss_bytes is not None else "-",
            f"{row.calls_per_s:.1f}" if row.calls_per_s is not None else "-",
            str(row.errors_total), str(row.restarts), row.last_error or "")
    lines = [f"FAILED: {state.failure}"] if state.failure else []
    if state.phases:
        now = " > ".join(p["name"] if p["track"] == "driver" else f"{p['track']}: {p['name']}"
                         for p in state.phases)
        step = state.phases[-1].get("step")
        lines.append(f"phase: {now}" + (f" (step {step})" if step is not None else ""))
    if state.last_phase is not None:
        last = state.last_phase
        took = f" {last['seconds']:.2f} s" if isinstance(last.get("seconds"), (int, float)) else ""
        lines.append(f"last finished: {last['track']}: {last['name']}{took}")
    if state.step is not None:
        values = "  ".join(f"{name}={_number(value)}" for name, value in state.metrics.items())
        lines.append(f"step {state.step}: {values}")
    gpus = sorted({(n, g) for n, g, _ in state.leases} | set(state.gpu_bytes))
    nodes = nodes or any(n for n, _ in gpus)
    for gpu in gpus:
        budgets = sorted(b for n, g, b in state.leases if (n, g) == gpu) or [""]
        line = (f"node {gpu[0]} " if nodes else "") + f"gpu {gpu[1]}: "
        line += ", ".join(_lease_text(b, state.leases.get((*gpu, b))) for b in budgets)
        held = state.gpu_bytes.get(gpu)
        if held:  # as each role last reported it (offload, onload, release)
            line += (f"; {format_bytes(sum(held.values()))} in use: "
                     + ", ".join(f"{h} {format_bytes(b)}" for h, b in sorted(held.items())))
        lines.append(line)
    if state.num_rejected:
        lines.append(f"rejected frames: {state.num_rejected} (last: {state.last_rejected})")
    return Group(table, Panel("\n".join(lines) or "no metrics or leases yet", title="training"))


def _lease_text(budget: str, lease: dict | None) -> str:
    """"lease actor (critic keeps 1 MiB)", or "trainers budget actor" on a side-by-side GPU."""
    lease = lease or {"holder": None, "residuals": {}}
    residuals = ", ".join(f"{h} keeps {format_bytes(b)}" for h, b in lease["residuals"].items())
    name = f"{budget} budget" if budget else "lease"
    return f"{name} {lease['holder'] or 'free'}" + (f" ({residuals})" if residuals else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.monitor", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print one JSON event per line")
    parser.add_argument("--once", action="store_true", help="show the events so far and exit")
    args = parser.parse_args(argv)
    if not (Path(args.run_dir) / SUPERVISOR_FILE).exists():
        print(f"error: {args.run_dir} has no {SUPERVISOR_FILE}; pass the run_dir of a Tandem job "
              f"(the supervisor writes it when it starts)", file=sys.stderr)
        return 2
    events = read_events(args.run_dir) if args.once else follow_events(args.run_dir)
    try:
        if args.json:
            for event in events:
                print(json.dumps(event), flush=True)
            return 0
        state = MonitorState()
        console = Console()
        if not console.is_terminal:  # rich assumes 80 columns for pipes and files; too narrow
            console = Console(width=140)
        if args.once:
            for event in events:
                state.apply(event)
            console.print(render(state, args.run_dir))
            return 0
        with Live(render(state, args.run_dir), console=console, refresh_per_second=4) as live:
            for event in events:
                state.apply(event)
                live.update(render(state, args.run_dir))
        return 0
    except KeyboardInterrupt:
        return 130


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
