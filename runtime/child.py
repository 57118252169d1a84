"""What runs inside a role process: boot, the mailbox loop, heartbeats and notices.

The main thread serves the mailbox (a ROUTER socket): one message at a time, FIFO per
sender. A control thread sends heartbeats with call counters to the supervisor and
applies its notices (a peer died or restarted) to this process's caller, so calls to a
dead peer fail at once here too. Anything that escapes writes the traceback to the
role's error file before the process ends.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import msgpack
import zmq

from runtime import shm, wire
from runtime.actor import ActorContext, endpoints_of
from runtime.errors import ActorDied
from runtime.handle import Address, Caller, Directory

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ChildBoot:
    """Everything a child needs to start; pickled once by multiprocessing's spawn."""

    name: str
    incarnation: int
    cls: type
    init_frames: list[bytes]  # [args, kwargs] in wire format (no pickle for user values)
    run_dir: str
    gpus: tuple[int, ...]
    mailbox: str
    control: str
    token: str
    max_message_bytes: int
    spin_us: int
    shm_prefix: str | None
    heartbeat_interval: float
    parent_pid: int
    error_file: str
    peers: tuple[tuple[str, int, str], ...]  # (name, incarnation, endpoint) known at spawn


def control_message(kind: str, token: str, payload: dict) -> list[bytes]:
    return [kind.encode(), token.encode(), msgpack.packb(payload, use_bin_type=True)]


def child_main(boot: ChildBoot) -> None:
    os.setsid()  # own session: a terminal's Ctrl-C goes to the supervisor, which stops us in order
    # When the supervisor dies, take down our whole process group (the role and anything it
    # started, e.g. an inference server's workers): a plain SIGKILL death signal would leave
    # grandchildren behind. The control thread checks the parent too, as a backup.
    signal.signal(signal.SIGUSR1, _orphaned)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != boot.parent_pid:  # the supervisor died before prctl took effect
        _orphaned()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    err = open(boot.error_file, "w")
    faulthandler.enable(err)  # segfaults and fatal signals leave a traceback too
    code = 0
    try:
        _Child(boot).run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        err.write(f"{boot.name} (incarnation {boot.incarnation}, pid {os.getpid()}) failed:\n")
        err.write(traceback.format_exc())
        err.flush()
        code = 1
    faulthandler.disable()
    empty = err.tell() == 0
    err.close()
    if empty:
        os.unlink(boot.error_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit hooks of libraries that may block on a dead peer


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def _orphaned(*_):
    os.killpg(0, signal.SIGKILL)


class _Child:
    def __init__(self, boot: ChildBoot):
        self.boot = boot
        self.ctx = zmq.Context()
        self.cfg = wire.WireConfig(token=boot.token, max_message_bytes=boot.max_message_bytes,
                                   shm_prefix=boot.shm_prefix, spin_us=boot.spin_us)
        shm.set_process_pool(self.cfg._pool)  # runtime.shared_empty in this role
        self.directory = Directory()
        for name, inc, ep in boot.peers:
            self.directory.update(Address(name, inc, ep))
        self.caller = Caller(self.ctx, self.cfg, boot.name, self.directory)
        self.calls = self.errors = self.rejected = 0
        self._events = self.ctx.socket(zmq.DEALER)
        self._events.setsockopt(zmq.LINGER, 2000)
        self._events.setsockopt(zmq.IDENTITY, f"{boot.name}#{boot.incarnation}#events".encode())
        self._events.connect(boot.control)
        self._events_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    def publish(self, event: str, **fields) -> None:
        with self._events_lock:
            self._events.send_multipart(control_message("event", self.boot.token,
                                                        {"event": event, **fields}))

    def run(self) -> None:
        boot = self.boot
        mailbox = self.ctx.socket(zmq.ROUTER)
        mailbox.setsockopt(zmq.LINGER, 1000)
        mailbox.setsockopt(zmq.MAXMSGSIZE, boot.max_message_bytes)
        mailbox.bind(boot.mailbox)
        threading.Thread(target=self._control_loop, name="tandem-control", daemon=True).start()

        obj = boot.cls.__new__(boot.cls)
        obj._tandem_ctx = ActorContext(boot.name, boot.incarnation, boot.run_dir, boot.gpus, self.publish)
        obj._tandem_state = "starting"
        hdr = wire.decode_header(self.cfg, boot.init_frames)
        args, kwargs = wire.decode_body(self.cfg, hdr, boot.init_frames, context=self.caller)
        obj.__init__(*args, **kwargs)
        if obj.state == "starting":  # a role may have moved to its own first state already
            obj.set_state("ready", pid=os.getpid())
        with self._events_lock:
            self._events.send_multipart(control_message("ready", boot.token, {"pid": os.getpid()}))
        self._serve(obj, mailbox, endpoints_of(boot.cls))

    # -- the mailbox -------------------------------------------------------------------
    def _serve(self, obj, mailbox: zmq.Socket, endpoints: frozenset[str]) -> None:
        spin_ns = self.cfg.spin_us * 1000
        idle_ns = replied = None  # how long the mailbox was idle before the last message
        while True:
            frames = mailbox.recv_multipart(copy=False)
            if replied is not None:
                idle_ns = time.perf_counter_ns() - replied
            ident, msg = frames[0], frames[1:]
            reply = self._handle(obj, endpoints, msg)
            if reply is not None:
                mailbox.send_multipart([ident, *reply.frames], copy=not reply.zero_copy)
            # While calls come in bursts (a caller's loop), poll a while before sleeping, as
            # callers do (runtime.handle), so the next call does not pay a cross-CPU wake-up.
            # When calls are far apart, polling would only take CPU from the work at hand.
            replied = time.perf_counter_ns()
            if idle_ns is not None and idle_ns <= spin_ns:
                end = replied + spin_ns
                while time.perf_counter_ns() < end and not mailbox.poll(0):
                    os.sched_yield()

    def _reject(self, reason: str) -> None:
        self.rejected += 1
        if self.rejected <= 10 or self.rejected % 100 == 0:  # a flood must not flood the event log
            self.publish("rejected", role=self.boot.name, incarnation=self.boot.incarnation,
                         reason=reason, count=self.rejected)

    def _handle(self, obj, endpoints, msg) -> wire.Encoded | None:
        try:
            hdr = wire.decode_header(self.cfg, msg)
        except wire.WireError as e:
            self._reject(str(e))
            return None
        if not wire.check_token(self.cfg, hdr):
            self._reject(f"bad token from {hdr.get('src')!r}")
            return None
        if hdr["kind"] != "call" or not isinstance(hdr["method"], str):
            wire.discard(self.cfg, hdr)
            self._reject(f"not a call: kind={hdr['kind']!r}")
            return None
        reply_hdr = {"kind": "reply", "id": hdr["id"], "src": self.boot.name, "dst": hdr["src"],
                     "method": hdr["method"], "inc": self.boot.incarnation, "deadline": None}
        deadline = hdr["deadline"]
        if isinstance(deadline, (int, float)) and time.time() > deadline:
            wire.discard(self.cfg, hdr)
            return wire.encode(self.cfg, dict(reply_hdr, kind="timeout"), None)
        self.calls += 1
        try:
            method = hdr["method"]
            if method not in endpoints:
                wire.discard(self.cfg, hdr)
                raise AttributeError(
                    f"{type(obj).__name__}.{method} is not an endpoint: decorate it with @endpoint")
            args, kwargs = wire.decode_body(self.cfg, hdr, msg, context=self.caller)
            result = getattr(obj, method)(*args, **kwargs)
            if asyncio.iscoroutine(result):
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                result = self._loop.run_until_complete(result)
            return wire.encode(self.cfg, reply_hdr, result)
        except Exception as e:
            self.errors += 1
            body = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
            return wire.encode(self.cfg, dict(reply_hdr, kind="error"), body)

    # -- heartbeats and notices -------------------------------------------------------------
    def _control_loop(self) -> None:
        boot = self.boot
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{boot.name}#{boot.incarnation}".encode())
        sock.connect(boot.control)
        next_beat = 0.0
        while True:
            if os.getppid() != boot.parent_pid:
                _orphaned()
            now = time.monotonic()
            if now >= next_beat:
                sock.send_multipart(control_message("heartbeat", boot.token, {
                    "calls": self.calls, "errors": self.errors, "rejected": self.rejected,
                    "stale_replies": self.caller.stale_replies, "bad_replies": self.caller.bad_replies}))
                next_beat = now + boot.heartbeat_interval
            if sock.poll(int(max(0.0, next_beat - time.monotonic()) * 1000)):
                kind, token, payload = sock.recv_multipart()
                if token.decode() == boot.token and kind == b"notice":
                    self._apply_notice(msgpack.unpackb(payload, raw=False))

    def _apply_notice(self, n: dict) -> None:
        if n["what"] == "died":
            err = ActorDied(n["name"], n["inc"], n["reason"], n.get("error_file"))
            self.directory.mark_dead(n["name"], n["inc"], err)
            self.caller.fail_destination(n["name"], n["inc"], err)
            self.caller.forget_endpoint(n["endpoint"])
        elif n["what"] == "started":
            self.directory.update(Address(n["name"], n["inc"], n["endpoint"]))
