"""Calling actors: handles, endpoint references, futures, and the per-process caller.

Every process (the driver and each role) has one ``Caller``. It keeps a DEALER socket
per destination mailbox and a table of pending calls. There is no I/O thread: the
thread that waits on a future pumps the sockets (one pumping thread at a time, others
wait on their future's event), so a blocking call costs one send and one receive.
Death notices from the supervisor fail pending futures from another thread and wake
the pump through an eventfd, which is how a dead actor fails its callers within
milliseconds instead of at a timeout.

A waiter first polls without sleeping for up to ``WireConfig.spin_us`` after the send,
unless that endpoint's previous reply took longer: a thread that sleeps in poll()
pays a cross-CPU wake-up when the reply lands, and on a small VM that is most of a
round trip (264 us p50 sleeping, 106-116 us polling: docs/journal/, "Runtime").
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import zmq

from runtime import curve, wire
from runtime.errors import ActorDied, CallTimeout, RemoteError, RuntimeActorError


@dataclass(frozen=True)
class Address:
    """Where one incarnation of an actor receives calls."""

    name: str
    incarnation: int
    endpoint: str


class Directory:
    """name -> current Address, kept up to date by the supervisor's notices."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_name: dict[str, Address] = {}
        self._dead: dict[str, ActorDied] = {}

    def update(self, addr: Address) -> None:
        with self._lock:
            cur = self._by_name.get(addr.name)
            if cur is None or addr.incarnation >= cur.incarnation:
                self._by_name[addr.name] = addr
                if cur is None or addr.incarnation > cur.incarnation:
                    self._dead.pop(addr.name, None)

    def mark_dead(self, name: str, incarnation: int, err: ActorDied) -> None:
        with self._lock:
            cur = self._by_name.get(name)
            if cur is not None and cur.incarnation == incarnation:
                self._dead[name] = err

    def resolve(self, name: str) -> Address:
        with self._lock:
            if name in self._dead:
                raise self._dead[name]
            try:
                return self._by_name[name]
            except KeyError:
                raise KeyError(f"no actor named {name!r} is known to this process") from None


class Future:
    """The pending result of one call. ``result()`` pumps the caller's sockets while it waits."""

    __slots__ = ("_caller", "_event", "_value", "_exc", "call_id", "dst", "method", "deadline", "segments",
                 "sent_ns")

    def __init__(self, caller: "Caller", call_id: int, dst: Address, method: str, deadline: float | None):
        self._caller, self.call_id, self.dst, self.method, self.deadline = caller, call_id, dst, method, deadline
        self.sent_ns = time.perf_counter_ns()
        self._event = threading.Event()
        self._value: Any = None
        self._exc: BaseException | None = None
        self.segments: list = []

    def done(self) -> bool:
        if not self._event.is_set():
            self._caller._pump_or_wait(self, 0.0)  # replies are only read when someone pumps
        return self._event.is_set()

    def _set(self, value: Any = None, exc: BaseException | None = None) -> None:
        self._value, self._exc = value, exc
        self._event.set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            self.result(timeout)
        except CallTimeout:
            if not self.done():
                raise
        except BaseException:
            pass
        return self._exc

    def result(self, timeout: float | None = None) -> Any:
        """The call's value; raises RemoteError, ActorDied or CallTimeout."""
        wait_until = None if timeout is None else time.monotonic() + timeout
        if not self._event.is_set():
            self._caller._spin(self, None if timeout is None else time.perf_counter_ns() + int(timeout * 1e9))
        while not self._event.is_set():
            now = time.monotonic()
            if self.deadline is not None and time.time() >= self.deadline:
                self._caller._expire(self)
                break
            if wait_until is not None and now >= wait_until:
                raise CallTimeout(f"{self.dst.name}: no reply within {timeout:.3g} s "
                                  f"(the call is still pending)")
            slice_s = 0.05
            if wait_until is not None:
                slice_s = min(slice_s, wait_until - now)
            if self.deadline is not None:
                slice_s = min(slice_s, max(0.0, self.deadline - time.time()))
            self._caller._pump_or_wait(self, max(slice_s, 0.0))
        if self._exc is not None:
            raise self._exc
        return self._value


class Caller:
    """Sends calls from this process and matches replies to futures."""

    def __init__(self, ctx: zmq.Context, cfg: wire.WireConfig, src: str, directory: Directory):
        self._ctx, self._cfg, self.src, self.directory = ctx, cfg, src, directory
        self._io_lock = threading.Lock()      # owns the sockets and the poller
        self._state_lock = threading.Lock()   # owns _pending
        self._sockets: dict[str, zmq.Socket] = {}
        self._poller = zmq.Poller()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self.stale_replies = 0
        self.bad_replies = 0
        self._closed = False
        self._spin_ns = cfg.spin_us * 1000
        self._reply_ns: dict[tuple[str, str], int] = {}  # the last reply's time, per (actor, method)

    # -- sending -----------------------------------------------------------------
    def call(self, name: str, method: str, args: tuple, kwargs: dict, timeout: float | None) -> Future:
        addr = self.directory.resolve(name)
        deadline = None if timeout is None else time.time() + timeout
        call_id = next(self._ids)
        header = {"kind": "call", "id": call_id, "src": self.src, "dst": name, "method": method,
                  "inc": addr.incarnation, "deadline": deadline}
        enc = wire.encode(self._cfg, header, [list(args), kwargs])  # TypeError here, at the caller
        fut = Future(self, call_id, addr, method, deadline)
        fut.segments = enc.segments
        with self._state_lock:
            self._pending[call_id] = fut
        try:
            with self._io_lock:
                if self._closed:
                    raise RuntimeActorError("this process's caller is closed")
                self._socket(addr.endpoint).send_multipart(enc.frames, copy=not enc.zero_copy)
        except BaseException:
            with self._state_lock:
                self._pending.pop(call_id, None)
            self._cfg.release(enc.segments)
            raise
        return fut

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 10)
            curve.connect(sock, endpoint, self._cfg.curve)
            self._sockets[endpoint] = sock
            self._poller.register(sock, zmq.POLLIN)
        return sock

    # -- receiving ---------------------------------------------------------------
    def _spin(self, fut: Future, until_ns: int | None) -> None:
        """Poll for ``fut``'s reply without sleeping, until spin_us after its send (or
        ``until_ns``, the waiter's own timeout on the perf_counter clock, if sooner)."""
        last = self._reply_ns.get((fut.dst.name, fut.method))
        if not self._spin_ns or (last is not None and last > self._spin_ns):
            return  # a slow endpoint: polling would only burn a CPU the actor may need
        end = fut.sent_ns + self._spin_ns
        if until_ns is not None:
            end = min(end, until_ns)
        while not fut._event.is_set() and time.perf_counter_ns() < end:
            if self._io_lock.acquire(blocking=False):  # per poll, so senders never wait long
                try:
                    self._pump(0.0)
                finally:
                    self._io_lock.release()
            os.sched_yield()  # let runnable threads of this CPU (ZeroMQ's I/O thread) go first

    def _pump_or_wait(self, fut: Future, timeout_s: float) -> None:
        if self._io_lock.acquire(blocking=False):
            try:
                if not fut.done():
                    self._pump(timeout_s)
            finally:
                self._io_lock.release()
        elif timeout_s > 0:
            fut._event.wait(min(timeout_s, 0.005))

    def _pump(self, timeout_s: float) -> None:
        # One message per ready socket: poll is level-triggered, so a socket with more
        # is ready again at once, and no recv ends in a (costly) zmq.Again.
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            if sock == self._wake_fd:
                os.eventfd_read(self._wake_fd)
            else:
                self._on_reply(sock.recv_multipart(zmq.NOBLOCK, copy=False))

    def _on_reply(self, frames: list) -> None:
        try:
            hdr = wire.decode_header(self._cfg, frames)
        except wire.WireError:
            self.bad_replies += 1
            return
        if not wire.check_token(self._cfg, hdr):
            self.bad_replies += 1
            return
        with self._state_lock:
            fut = self._pending.get(hdr["id"])
            if fut is not None and hdr["inc"] == fut.dst.incarnation:
                del self._pending[hdr["id"]]
                self._reply_ns[fut.dst.name, fut.method] = time.perf_counter_ns() - fut.sent_ns
            else:
                fut = None
                self.stale_replies += 1  # a reply from a dead incarnation, or for an expired call
        if fut is None:
            wire.discard(self._cfg, hdr)  # its arrays were never going to be read
            return
        try:
            body = wire.decode_body(self._cfg, hdr, frames, context=self)
        except wire.WireError as e:
            fut._set(exc=RuntimeActorError(f"reply from {fut.dst.name} is malformed: {e}"))
            return
        kind = hdr["kind"]
        if kind == "reply":
            fut._set(value=body)
        elif kind == "error":
            fut._set(exc=RemoteError(fut.dst.name, hdr["method"], body["type"], body["message"],
                                     body["traceback"]))
        elif kind == "timeout":
            fut._set(exc=CallTimeout(f"{fut.dst.name}.{hdr['method']}: the deadline passed "
                                     "before the actor started the call"))
        else:
            fut._set(exc=RuntimeActorError(f"unexpected reply kind {kind!r}"))

    # -- failing -------------------------------------------------------------------
    def _expire(self, fut: Future) -> None:
        with self._state_lock:
            if self._pending.pop(fut.call_id, None) is None:
                return
        fut._set(exc=CallTimeout(f"{fut.dst.name}: no reply before the call's deadline"))

    def fail_destination(self, name: str, incarnation: int, err: ActorDied) -> int:
        """Fail every pending call to one incarnation of an actor; returns how many."""
        with self._state_lock:
            doomed = [f for f in self._pending.values()
                      if f.dst.name == name and f.dst.incarnation == incarnation]
            for f in doomed:
                del self._pending[f.call_id]
        for f in doomed:
            self._cfg.release(f.segments)  # the dead receiver will never read them
            f._set(exc=err)
        os.eventfd_write(self._wake_fd, 1)
        return len(doomed)

    def fail_all(self, err: RuntimeActorError) -> None:
        with self._state_lock:
            doomed = list(self._pending.values())
            self._pending.clear()
        for f in doomed:
            f._set(exc=err)
        os.eventfd_write(self._wake_fd, 1)

    def forget_endpoint(self, endpoint: str) -> None:
        """Close the socket to a dead incarnation so queued messages are dropped."""
        with self._io_lock:
            sock = self._sockets.pop(endpoint, None)
            if sock is not None:
                self._poller.unregister(sock)
                sock.close(linger=0)

    def close(self) -> None:
        with self._io_lock:
            self._closed = True
            for sock in self._sockets.values():
                sock.close(linger=0)
            self._sockets.clear()
            os.close(self._wake_fd)


def gather(futures: Iterable[Future], timeout: float | None = None) -> list:
    """Results of several futures, in order; the first error is raised."""
    until = None if timeout is None else time.monotonic() + timeout
    out = []
    for f in futures:
        out.append(f.result(None if until is None else max(0.0, until - time.monotonic())))
    return out


def wait_any(futures: Iterable[Future], timeout: float | None = None) -> list[Future]:
    """Block until at least one future is done (or the timeout passes); return the done ones."""
    pending = list(futures)
    until = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [f for f in pending if f.done()]
        if done or not pending or (until is not None and time.monotonic() >= until):
            return done
        pending[0]._caller._pump_or_wait(pending[0], 0.01)


# -- handles ---------------------------------------------------------------------------

class EndpointRef:
    """``handle.method``: ``.call(...)`` returns a Future, calling it blocks for the value."""

    def __init__(self, handle: "ActorHandle", method: str):
        self._handle, self._method = handle, method

    def call(self, *args, timeout: float | None = None, **kwargs) -> Future:
        h = self._handle
        return h._caller.call(h.name, self._method, args, kwargs, timeout)

    def __call__(self, *args, timeout: float | None = None, **kwargs) -> Any:
        return self.call(*args, timeout=timeout, **kwargs).result()

    def __repr__(self) -> str:
        return f"<endpoint {self._handle.name}.{self._method}>"


class ActorHandle:
    """A reference to a named actor; survives restarts (calls go to the current incarnation)."""

    def __init__(self, name: str, cls_name: str, endpoints: frozenset[str], caller: Caller,
                 killer=None):
        self.name, self.cls_name, self.endpoints = name, cls_name, endpoints
        self._caller = caller
        self._killer = killer  # set in the supervisor's process only

    def __getattr__(self, method: str) -> EndpointRef:
        if method.startswith("_"):
            raise AttributeError(method)
        if method not in self.endpoints:
            raise AttributeError(
                f"{self.cls_name}.{method} is not an endpoint of actor {self.name!r}: decorate it "
                f"with @endpoint to call it remotely (endpoints: {', '.join(sorted(self.endpoints)) or 'none'})")
        return EndpointRef(self, method)

    @property
    def incarnation(self) -> int:
        return self._caller.directory.resolve(self.name).incarnation

    def kill(self, sig: int = 9) -> None:
        """Send a signal to the actor's process (tests and fault injection)."""
        if self._killer is None:
            raise RuntimeActorError("kill() is only available in the supervisor's process")
        self._killer(self.name, sig)

    def __repr__(self) -> str:
        return f"<ActorHandle {self.name} ({self.cls_name})>"


class ActorGroup:
    """Several actors addressed together: ``group.method.call(...)`` broadcasts."""

    def __init__(self, handles: Iterable[ActorHandle]):
        self.handles = list(handles)

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self):
        return iter(self.handles)

    def __getitem__(self, i: int) -> ActorHandle:
        return self.handles[i]

    def __getattr__(self, method: str) -> "GroupEndpointRef":
        if method.startswith("_"):
            raise AttributeError(method)
        for h in self.handles:
            getattr(h, method)  # same fix-it error as a single handle
        return GroupEndpointRef(self, method)


class GroupEndpointRef:
    def __init__(self, group: ActorGroup, method: str):
        self._group, self._method = group, method

    def call(self, *args, timeout: float | None = None, **kwargs) -> list[Future]:
        return [getattr(h, self._method).call(*args, timeout=timeout, **kwargs) for h in self._group]

    def __call__(self, *args, timeout: float | None = None, **kwargs) -> list:
        return gather(self.call(*args, timeout=timeout, **kwargs))


def _handle_state(h: ActorHandle) -> list:
    addr = h._caller.directory.resolve(h.name)
    return [h.name, h.cls_name, sorted(h.endpoints), addr.incarnation, addr.endpoint]


def _handle_from_state(state: list, caller: Caller) -> ActorHandle:
    if caller is None:
        raise wire.WireError("an actor handle arrived where no caller can use it")
    name, cls_name, endpoints, inc, endpoint = state
    caller.directory.update(Address(name, inc, endpoint))
    return ActorHandle(name, cls_name, frozenset(endpoints), caller)


wire.register_object_codec(wire.ObjectCodec("actor_handle", ActorHandle, _handle_state, _handle_from_state))
