"""The structured event bus: what the supervisor saw happen, for monitors and post-mortems.

The supervisor owns one `EventBus`. Each event is a flat dict
`{"event": name, "seq": n, "ts": unix_time, **fields}` with seq = 1, 2, 3, ... It is
appended to `<run_dir>/events.jsonl` and then published on a zmq PUB socket at
`ipc://<run_dir>/sockets/events.sock` as frames [name, msgpack(dict)]. The file is the
source of truth; the socket only makes followers fast. `follow_events` replays the file
and continues live, so a monitor attached late sees the whole run, each event once.

Vocabulary (fields besides event/seq/ts):
  supervisor_started  pid, run_dir
  spawned             role, incarnation, pid, gpus, restart, group; a process was started
  ready               role, incarnation, pid, gpus; it finished __init__ and takes calls
  state               role, incarnation, pid, gpus, old, new; the role lifecycle, one of
                      starting, ready, offloaded, training, dead
  died                role, incarnation, pid, gpus, reason, error_file (None when it wrote none)
  restarted           role, incarnation (the new one), pid, gpus, reason, restarts
  hung                role, incarnation, pid, silent_s (seconds without a heartbeat)
  failed              reason, error_file; the supervisor gave up (restart intensity, start-up)
  role_stats          roles: {role: {incarnation, pid, rss_bytes, cpu, calls_total,
                      errors_total, rejected_total}}; periodic, cpu in percent of one core,
                      the totals count since that incarnation started
  lease               gpu, holder, action (acquire | release | report), bytes_left,
                      residuals {holder: bytes}; see runtime.memory.LeaseTable
  metrics             step, metrics {name: number}; one PPO training step
  phase               phase, action (begin | end | span), track, step; a span of work: the
                      driver publishes begin/end with track "driver", a role one `span` when
                      done (Actor.publish_span; role added). end and span carry seconds, span
                      t0 (unix start); optional gpus and bytes_in_use (the track's bytes on each
                      of those GPUs after it), bytes (moved), other plain fields
  socket              socket, what (connected | disconnected | accepted | closed), endpoint
  rejected            role, reason, and count from roles; a frame with a bad token or that
                      does not decode (role "supervisor" for the control socket)
  shutdown            reason; always the last event of a run

A supervisor restarted on the same run dir keeps the previous log as events.<k>.jsonl.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import msgpack
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

EVENTS_FILE = "events.jsonl"
SUPERVISOR_FILE = "supervisor.json"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_MAX_IPC_PATH = 107

_SOCKET_EVENTS = {
    zmq.EVENT_CONNECTED: "connected",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_ACCEPTED: "accepted",
    zmq.EVENT_CLOSED: "closed",
}


class EventBus:
    """Supervisor side: publish events to the run's log file and PUB socket; thread-safe.

    Writes <run_dir>/supervisor.json {pid, started, events_endpoint}, plus `ended` on close.
    A run_dir whose supervisor still runs is refused (RuntimeError).
    """

    def __init__(self, run_dir: str | os.PathLike, *, socket_dir: str | os.PathLike | None = None):
        """``socket_dir`` (mode 0700) defaults to ``<run_dir>/sockets``; the supervisor passes a
        short one when the run dir is too deep for a unix socket path."""
        self.run_dir = Path(run_dir)
        sockets = Path(socket_dir) if socket_dir is not None else self.run_dir / "sockets"
        sockets.mkdir(mode=0o700, parents=True, exist_ok=True)
        sockets.chmod(0o700)  # mkdir's mode is masked by umask and ignored when the dir exists
        socket_path = str((sockets / "events.sock").absolute())
        if len(socket_path.encode()) > _MAX_IPC_PATH:
            raise ValueError(f"the events socket path {socket_path!r} has {len(socket_path.encode())} "
                             f"bytes, the limit is {_MAX_IPC_PATH}; use a shorter run_dir or socket_dir")
        self.endpoint = f"ipc://{socket_path}"
        info_path = self.run_dir / SUPERVISOR_FILE
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if "ended" not in info and _alive(info):
                raise RuntimeError(f"run_dir {str(run_dir)!r} is in use by the supervisor with pid "
                                   f"{info['pid']}; stop it or use another run_dir")
        self._rotate_previous_log()
        self._lock = threading.Lock()
        self._seq = 0
        self._file = open(self.run_dir / EVENTS_FILE, "a", buffering=1)  # line-buffered
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.endpoint)
        self._info = {"pid": os.getpid(), "started": time.time(), "events_endpoint": self.endpoint}
        _write_json_atomic(info_path, self._info)
        self._closed = False

    def publish(self, event: str, **fields) -> dict:
        """Log and publish one event; returns it as followers will see it."""
        reserved = {"event", "seq", "ts"} & set(fields)
        if reserved:
            raise ValueError(f"event fields {sorted(reserved)} are reserved; rename them")
        with self._lock:
            return self._publish_locked(event, fields)

    def close(self, reason: str = "closed") -> None:
        """Publish `shutdown` and close the socket and log; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._publish_locked("shutdown", {"reason": reason})
            self._closed = True
            self._socket.close()
            self._context.term()
            self._file.close()
            _write_json_atomic(self.run_dir / SUPERVISOR_FILE, {**self._info, "ended": time.time()})

    def __enter__(self) -> EventBus:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _publish_locked(self, event: str, fields: dict) -> dict:
        if self._closed:
            raise RuntimeError(f"EventBus of {self.run_dir} is closed; cannot publish {event!r}")
        self._seq += 1
        line = json.dumps({"event": event, "seq": self._seq, "ts": time.time(), **fields}, default=_plain)
        # Round-trip through JSON so live followers get exactly what the file replays
        # (str keys, lists for tuples, plain numbers for numpy scalars).
        record = json.loads(line)
        self._file.write(line + "\n")  # file first: a live event is always in the file
        self._socket.send_multipart([event.encode(), msgpack.packb(record)])
        return record

    def _rotate_previous_log(self) -> None:
        log = self.run_dir / EVENTS_FILE
        if not log.exists():
            return
        k = 1
        while (self.run_dir / f"events.{k}.jsonl").exists():
            k += 1
        log.rename(self.run_dir / f"events.{k}.jsonl")


def read_events(run_dir: str | os.PathLike) -> list[dict]:
    """The events logged so far by the run's current supervisor (complete lines only)."""
    events, _ = _read_new(Path(run_dir) / EVENTS_FILE, 0)
    return events


def follow_events(run_dir: str | os.PathLike, *, from_start: bool = True, poll_s: float = 0.2) -> Iterator[dict]:
    """Yield the run's events in seq order, each exactly once, past then live.

    from_start=False skips the events logged before the call. Ends after a `shutdown`
    event, or when the supervisor process is gone and its log is drained. Read-only:
    it never writes into the run dir. FileNotFoundError when run_dir has no supervisor.json.
    """
    run_dir = Path(run_dir)
    info_path = run_dir / SUPERVISOR_FILE
    if not info_path.exists():
        raise FileNotFoundError(f"{run_dir} has no {SUPERVISOR_FILE}: not a Tandem run dir, "
                                f"or its supervisor has not started yet")
    info = json.loads(info_path.read_text())
    past = [] if from_start else read_events(run_dir)  # "now" is the call, not the first next()
    return _follow(run_dir, info, past[-1]["seq"] + 1 if past else 1, poll_s)


def _follow(run_dir: Path, info: dict, first_seq: int, poll_s: float) -> Iterator[dict]:
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        # Subscribe before reading the file: every event is then in the file, on the
        # socket, or both; the seq numbers stitch the two together.
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(info["events_endpoint"])
        log = run_dir / EVENTS_FILE
        past, offset = _read_new(log, 0)
        expected = first_seq
        pending: dict[int, dict] = {}  # events not yet yielded, by seq

        def take(events: list[dict]) -> None:
            for event in events:
                if event["seq"] >= expected:
                    pending[event["seq"]] = event

        take(past)
        while True:
            while expected in pending:
                event = pending.pop(expected)
                expected += 1
                yield event
                if event["event"] == "shutdown":
                    return
            if pending:  # a gap: missed live while the subscription was connecting
                new, offset = _read_new(log, offset)  # the file has everything published
                take(new)
                if expected in pending:
                    continue
            if socket.poll(int(poll_s * 1000)):
                while socket.poll(0):
                    _, payload = socket.recv_multipart()
                    take([msgpack.unpackb(payload)])
                continue
            # A quiet socket: catch up from the file, then see whether the supervisor is gone.
            new, offset = _read_new(log, offset)
            take(new)
            if expected not in pending and not _alive(info):
                new, offset = _read_new(log, offset)  # it may have logged until its last moment
                take(new)
                if expected not in pending:
                    return
    finally:
        socket.close()
        context.term()


def watch_socket(sock: zmq.Socket, bus: EventBus, name: str) -> threading.Thread:
    """Re-publish `sock`'s connects, disconnects, accepts and closes as `socket` events.

    Runs in a daemon thread, returned; it ends when the monitor stops (sock.disable_monitor()
    or sock closed) or the context terminates.
    """
    monitor = sock.get_monitor_socket(
        zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_CLOSED
        | zmq.EVENT_MONITOR_STOPPED)

    def relay() -> None:
        try:
            while True:
                message = recv_monitor_message(monitor)
                if message["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                endpoint = message["endpoint"]
                bus.publish("socket", socket=name, what=_SOCKET_EVENTS[message["event"]],
                            endpoint=endpoint.decode() if isinstance(endpoint, bytes) else endpoint)
        except zmq.ContextTerminated:
            return
        finally:
            monitor.close(linger=0)

    thread = threading.Thread(target=relay, name=f"watch-socket-{name}", daemon=True)
    thread.start()
    return thread


def _read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    """Complete lines of `path` from byte `offset` on, and the offset after them."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line without its newline is still being written
    return [json.loads(line) for line in data[:end].splitlines() if line], offset + end


def _alive(info: dict) -> bool:
    """Whether the supervisor of supervisor.json still runs (not a later process with its pid)."""
    try:
        process = psutil.Process(info["pid"])
        return (process.status() != psutil.STATUS_ZOMBIE
                and process.create_time() <= info["started"] + 1.0)
    except psutil.NoSuchProcess:
        return False


def _plain(value):
    """JSON fallback for numpy scalars and arrays (anything with tolist())."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"event field value {value!r} of type {type(value).__name__} is not JSON-serialisable")


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
