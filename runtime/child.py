"""What runs inside a role process: boot, the mailbox loop, heartbeats and notices.

The main thread serves the mailbox (a ROUTER socket): one message at a time, FIFO per
sender. A control thread sends heartbeats with call counters to the supervisor and
applies its notices (a peer died or restarted) to this process's caller, so calls to a
dead peer fail at once here too. Anything that escapes writes the traceback to the
role's error file before the process ends.

Start-up failures are the ones users meet first (a reward module that does not import
in a fresh interpreter, a class defined inside a function, a script without a
``__main__`` guard), so they get an error file with the likely fix too: the role's class
travels as pickled bytes and is unpickled inside ``child_main``, where a failure is
caught; what fails even earlier, in multiprocessing's own bootstrap, is diagnosed by the
supervisor from the missing error file (``describe_silent_start``).
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, fields

import msgpack
import zmq

from runtime import curve, shm, wire
from runtime.actor import ActorContext, endpoints_of
from runtime.errors import ActorDied
from runtime.handle import Address, Caller, Directory
from runtime.noise import route_library_noise
from runtime.process import kill_session_but_self

PR_SET_PDEATHSIG = 1
ERROR_FILE_ENV = "TANDEM_ERROR_FILE"  # set in a child's environment: its error file, for bootstrap failures


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
    group: str | None = None  # the child spec's group (a rank group's role name)
    stop_timeout_s: float = 2.0  # the role's on_stop; then its session is killed (under the supervisor's grace)
    curve: tuple[bytes, bytes] | None = None  # the job's CURVE key pair (public, secret) across nodes

    def __reduce__(self):
        # The class goes as pickled bytes: unpickling it imports the user's module, and an
        # import error there must happen inside child_main (error file, likely fix), not in
        # multiprocessing's bootstrap, which only prints to stderr and exits 1.
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        try:
            state["cls"] = _PickledClass(pickle.dumps(self.cls))
        except Exception as e:
            raise StartupError(
                f"role {self.name!r}: cannot send its class {self.cls!r} to the new process ({e}). "
                "Likely fix: define the class at the top level of an importable module (not inside "
                "a function, not in an interactive session), since the spawn start method sends "
                "it by name") from e
        return (_rebuild_boot, (state,))

    def load_class(self) -> type:
        return pickle.loads(self.cls.data) if isinstance(self.cls, _PickledClass) else self.cls


@dataclass(frozen=True)
class _PickledClass:
    data: bytes


def _rebuild_boot(state: dict) -> ChildBoot:
    return ChildBoot(**state)


class StartupError(RuntimeError):
    """A role cannot be started; the message names the role and the likely fix."""


def likely_fix(exc: BaseException, phase: str) -> str | None:
    """A one-line hint for the start-up failures users meet most, or None."""
    if isinstance(exc, ImportError):
        return ("the module exists in the parent but not in this fresh interpreter: install it into "
                "this environment, or put its directory on PYTHONPATH (a role is a new process "
                "started with the spawn method; it imports every module again)")
    if isinstance(exc, (AttributeError, pickle.UnpicklingError)) and phase == "unpickling its class":
        return ("define the role's class at the top level of an importable module; a class defined "
                "in a script run from stdin or inside a function cannot be found by name in a new process")
    if isinstance(exc, SystemExit):
        return "the role called sys.exit() while starting; raise an exception with a message instead"
    return None


def refuse_bootstrap_reentry(what: str) -> None:
    """Raise (and write the child's error file) when ``what`` runs while a spawned child
    re-imports the main module: the script has no ``if __name__ == "__main__":`` guard."""
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return  # multiprocessing sets _inheriting only while a spawned child prepares its main module
    # runpy registers the module being re-run as __mp_main__ until it has finished
    main = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "the main script"
    message = (f"{what} ran while a spawned role process was importing {main} again: the spawn start "
               f"method runs the main module's top-level code in every role. Likely fix: put the "
               f"code that starts the run under `if __name__ == \"__main__\":` in {main}.")
    error_file = os.environ.get(ERROR_FILE_ENV)
    if error_file:
        try:
            with open(error_file, "w") as f:
                f.write(f"pid {os.getpid()} failed while importing the main module:\n{message}\n")
        except OSError:
            pass
    raise StartupError(message)


def describe_silent_start(name: str, cls: type, reason: str) -> str:
    """What the supervisor writes as the error file of a child that died before Tandem's
    code ran in it (no error file at all): the likely causes, most common first."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    lines = [f"{name} {reason} before its actor code ran, in multiprocessing's bootstrap "
             "(its traceback went to the process's stderr).",
             "This file was written by the supervisor. Likely fixes:"]
    if main:
        lines.append(f"- {main} is imported again in every role (spawn start method): code at its top "
                     "level must not fail or start a run there; put it under "
                     "`if __name__ == \"__main__\":` and check its top-level imports work in a fresh "
                     "interpreter")
    lines.append(f"- `python -c 'import {cls.__module__}'` must work in a fresh interpreter with the "
                 "role's environment (CUDA_VISIBLE_DEVICES, PYTHONPATH)")
    return "\n".join(lines) + "\n"


def control_message(kind: str, token: str, payload: dict) -> list[bytes]:
    return [kind.encode(), token.encode(), msgpack.packb(payload, use_bin_type=True)]


def child_main(boot: ChildBoot) -> None:
    os.setsid()  # own session: a terminal's Ctrl-C goes to the supervisor, which stops us in order
    # When the supervisor dies, take down our whole process group (the role and anything it
    # started, e.g. an inference server's workers): a plain SIGKILL death signal would leave
    # grandchildren behind. The control thread checks the parent too, as a backup.
    orphaned = functools.partial(_orphaned, boot.parent_pid)
    signal.signal(signal.SIGUSR1, orphaned)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    orphaned()  # the supervisor died before prctl took effect
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    err = open(boot.error_file, "w")
    faulthandler.enable(err)  # segfaults and fatal signals leave a traceback too
    route_library_noise(boot.run_dir, source=boot.name)  # before the role's class imports its libraries
    code = 0
    child = None
    try:
        child = _Child(boot)
        child.run()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
        if code and (child is None or child.phase != "serving"):
            _write_failure(err, boot, child.phase if child else "connecting", e)
    except BaseException as e:
        _write_failure(err, boot, child.phase if child else "connecting", e)
        code = 1
    if child is not None and child.obj is not None:
        _stop_role(child.obj, boot.stop_timeout_s, err)
    faulthandler.disable()
    empty = err.tell() == 0
    err.close()
    if empty:
        os.unlink(boot.error_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip atexit hooks of libraries that may block on a dead peer


def _write_failure(err, boot: ChildBoot, phase: str, exc: BaseException) -> None:
    err.write(f"{boot.name} (incarnation {boot.incarnation}, pid {os.getpid()}) failed while {phase}:\n")
    err.write(traceback.format_exc())
    fix = likely_fix(exc, phase)
    if fix:
        err.write(f"Likely fix: {fix}\n")
    err.flush()


def _stop_role(obj, timeout_s: float, err) -> None:
    """The role's on_stop (runtime.actor), given `timeout_s`; then what the role started and
    left in its session is killed, so nothing of it outlives the role (os._exit skips the
    atexit hooks that would have stopped it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the hook short
    done = threading.Event()

    def run() -> None:
        try:
            obj.on_stop()
        except BaseException:
            err.write(f"{type(obj).__name__}.on_stop failed:\n{traceback.format_exc()}")
        finally:
            done.set()

    threading.Thread(target=run, name="tandem-on-stop", daemon=True).start()
    if not done.wait(timeout_s):
        err.write(f"{type(obj).__name__}.on_stop did not return within {timeout_s} s; killing what the role "
                  "started\n")
    err.flush()
    kill_session_but_self()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)


def _orphaned(parent_pid: int, *_) -> None:
    """The death signal: take our process group down if the supervisor is gone. Slurm's
    `--signal=USR1@T` and `scancel --signal=USR1` send SIGUSR1 to every process of the step, the
    roles too: that one, with the supervisor alive, is the driver's (a checkpoint) and ignored."""
    if os.getppid() != parent_pid:
        os.killpg(0, signal.SIGKILL)


class _Child:
    def __init__(self, boot: ChildBoot):
        self.boot = boot
        self.phase = "connecting"  # what the error file says the role was doing when it failed
        self.obj = None  # the role, once its __init__ runs
        self.ctx = zmq.Context()
        keys = curve.KeyPair(*boot.curve) if boot.curve else None
        self.cfg = wire.WireConfig(token=boot.token, max_message_bytes=boot.max_message_bytes,
                                   shm_prefix=boot.shm_prefix, spin_us=boot.spin_us, curve=keys)
        # a ZAP handler of this process's context: only the job's key gets into the mailbox
        self.gate = curve.Gatekeeper(self.ctx, [keys.public]) if keys else None
        shm.set_process_pool(self.cfg._pool)  # runtime.shared_empty in this role
        self.directory = Directory()
        for name, inc, ep in boot.peers:
            self.directory.update(Address(name, inc, ep))
        self.caller = Caller(self.ctx, self.cfg, boot.name, self.directory)
        self.calls = self.errors = self.rejected = 0
        self._events = self.ctx.socket(zmq.DEALER)
        self._events.setsockopt(zmq.LINGER, 2000)
        self._events.setsockopt(zmq.IDENTITY, f"{boot.name}#{boot.incarnation}#events".encode())
        curve.connect(self._events, boot.control, self.cfg.curve)
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
        if self.cfg.curve is not None:
            curve.make_server(mailbox, self.cfg.curve)
        mailbox.bind(boot.mailbox)
        threading.Thread(target=self._control_loop, name="tandem-control", daemon=True).start()

        self.phase = "unpickling its class"
        cls = boot.load_class()
        obj = cls.__new__(cls)
        obj._tandem_ctx = ActorContext(boot.name, boot.incarnation, boot.run_dir, boot.gpus, self.publish,
                                       group=boot.group)
        obj._tandem_state = "starting"
        self.phase = "decoding its arguments"
        hdr = wire.decode_header(self.cfg, boot.init_frames)
        args, kwargs = wire.decode_body(self.cfg, hdr, boot.init_frames, context=self.caller)
        self.phase = f"running {cls.__name__}.__init__"
        self.obj = obj  # from here on, on_stop runs as the process ends (what __init__ started may need it)
        obj.__init__(*args, **kwargs)
        if obj.state == "starting":  # a role may have moved to its own first state already
            obj.set_state("ready", pid=os.getpid())
        with self._events_lock:
            self._events.send_multipart(control_message("ready", boot.token, {"pid": os.getpid()}))
        self.phase = "serving"
        self._serve(obj, mailbox, endpoints_of(cls))

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
            began = time.time()
            result = getattr(obj, method)(*args, **kwargs)
            if asyncio.iscoroutine(result):
                if self._loop is None:
                    self._loop = asyncio.new_event_loop()
                result = self._loop.run_until_complete(result)
            self._report_cuda_memory(method, began)
            return wire.encode(self.cfg, reply_hdr, result)
        except Exception as e:
            self.errors += 1
            body = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
            return wire.encode(self.cfg, dict(reply_hdr, kind="error"), body)

    def _report_cuda_memory(self, method: str, began: float) -> None:
        """On a real GPU, the CUDA allocator's peak during the call and what it holds after,
        as a `cuda_memory` event: what the memory plan's phases are held against
        (ppo.gpu.plan_check.cuda_mismatches). Nothing where CUDA never started in this process."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return
        self.publish("cuda_memory", role=self.boot.name, gpus=list(self.boot.gpus), method=method, began=began,
                     ended=time.time(), peak=torch.cuda.max_memory_allocated(), held=torch.cuda.memory_allocated())
        torch.cuda.reset_peak_memory_stats()

    # -- heartbeats and notices -------------------------------------------------------------
    def _control_loop(self) -> None:
        boot = self.boot
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"{boot.name}#{boot.incarnation}".encode())
        curve.connect(sock, boot.control, self.cfg.curve)
        next_beat = 0.0
        while True:
            _orphaned(boot.parent_pid)  # a backup of the death signal
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
