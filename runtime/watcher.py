"""The supervisor's watch thread: control messages, process sentinels, heartbeats and stats.

It only observes: a child's heartbeat, readiness and events update its record and go to the
bus; a death (a sentinel, a missed heartbeat, a start that never finished) is handed to the
supervisor's `on_death`, which owns the restart policy.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from typing import Callable

import msgpack
import psutil
import zmq

from runtime.events import EventBus
from runtime.process import Child, exit_reason, kill_tree


class Watcher:
    """Watches the children that `watched()` returns, each as (child, incarnation): the
    incarnation is read under the supervisor's lock, so a restart meanwhile is never judged,
    or killed, by what was read of the process before it."""

    def __init__(self, *, control: zmq.Socket, token: str, bus: EventBus,
                 watched: Callable[[], list[tuple[Child, int]]], find: Callable[[str], Child | None],
                 on_death: Callable[[Child, int, str], None], heartbeat_timeout: float,
                 ready_timeout_s: float, stats_interval_s: float):
        self._control, self._token, self.bus = control, token.encode(), bus
        self._watched, self._find, self._on_death = watched, find, on_death
        self.heartbeat_timeout, self.ready_timeout_s = heartbeat_timeout, ready_timeout_s
        self.stats_interval_s = stats_interval_s
        self._stopping = False
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="tandem-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Poll again now: a child was started (a new sentinel) or the watch must stop."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self.wake()
        self._thread.join(timeout=timeout)
        os.close(self._wake_fd)

    def _run(self) -> None:
        next_stats = time.monotonic() + self.stats_interval_s
        while not self._stopping:
            poller = zmq.Poller()
            poller.register(self._control, zmq.POLLIN)
            poller.register(self._wake_fd, zmq.POLLIN)
            live = {c.process.sentinel: (c, inc) for c, inc in self._watched() if c.process is not None}
            for fd in live:
                poller.register(fd, zmq.POLLIN)
            for sock, _ in poller.poll(100):
                if sock is self._control:
                    self._drain_control()
                elif sock == self._wake_fd:
                    os.eventfd_read(self._wake_fd)
                elif sock in live and not self._stopping:
                    child, incarnation = live[sock]
                    self._on_death(child, incarnation, exit_reason(child.process))
            if self._stopping:
                break
            self._check_heartbeats()
            if time.monotonic() >= next_stats:
                self._publish_stats()
                next_stats = time.monotonic() + self.stats_interval_s

    def _drain_control(self) -> None:
        while True:
            try:
                ident, kind, token, payload = self._control.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                self.bus.publish("rejected", role="supervisor", reason="malformed control message")
                continue
            if not secrets.compare_digest(token, self._token):
                self.bus.publish("rejected", role="supervisor", reason="bad token on control socket")
                continue
            try:
                data = msgpack.unpackb(payload, raw=False)
                name, inc = ident.decode().split("#")[:2]
                child = self._find(name)
            except Exception:
                self.bus.publish("rejected", role="supervisor", reason="malformed control payload")
                continue
            if child is None or int(inc) != child.incarnation or child.state == "dead":
                continue  # a message from a dead incarnation
            if kind == b"heartbeat":
                child.last_beat = time.monotonic()
                child.stats = data
            elif kind == b"ready":
                child.state, child.ever_ready = "ready", True
                self.bus.publish("ready", role=name, incarnation=child.incarnation, pid=data["pid"],
                                 gpus=list(child.spec.gpus))
            elif kind == b"event":
                event = data.pop("event")
                self.bus.publish(event, **{"role": name, "incarnation": child.incarnation,
                                           "pid": child.process.pid, **data})

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for c, incarnation in self._watched():
            process = c.process
            if c.incarnation != incarnation or process is None:  # restarted since
                continue
            if c.last_beat is not None and now - c.last_beat > self.heartbeat_timeout:
                self.bus.publish("hung", role=c.spec.name, incarnation=incarnation, pid=process.pid,
                                 silent_s=round(now - c.last_beat, 3))
                kill_tree(process.pid)
                process.join(timeout=5)
                self._on_death(c, incarnation, f"hung: no heartbeat for {now - c.last_beat:.1f} s "
                                               f"(heartbeat_timeout={self.heartbeat_timeout} s); killed")
            elif c.last_beat is None and now - c.started_at > self.ready_timeout_s:
                kill_tree(process.pid)
                process.join(timeout=5)
                self._on_death(c, incarnation, f"did not start within ready_timeout_s={self.ready_timeout_s}")

    def _publish_stats(self) -> None:
        roles = {}
        for c, _ in self._watched():
            try:
                if c.ps is None or c.ps.pid != c.process.pid:
                    c.ps = psutil.Process(c.process.pid)  # cpu_percent measures since the last call
                rss, cpu = c.ps.memory_info().rss, c.ps.cpu_percent(None)
            except (psutil.Error, AttributeError):
                continue
            roles[c.spec.name] = {"incarnation": c.incarnation, "pid": c.process.pid, "rss_bytes": rss,
                                  "cpu": cpu, "calls_total": c.stats.get("calls", 0),
                                  "errors_total": c.stats.get("errors", 0),
                                  "rejected_total": c.stats.get("rejected", 0) + c.stats.get("bad_replies", 0)}
        self.bus.publish("role_stats", roles=roles)
