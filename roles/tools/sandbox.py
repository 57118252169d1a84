"""One tool call in a sandbox: bubblewrap (``bwrap``) around a fresh Python that runs
``roles.tools.runner``, with resource limits, a wall-clock timeout and an output cap.

What bwrap gives each call (docs/tools.md says what holds where):

- ``--unshare-net``: a network namespace with only a loopback that is down: no network;
- ``--unshare-pid --die-with-parent``: the call's processes live in a PID namespace of their
  own that dies with its first process, which dies with the worker; a timeout kills them all;
- ``--unshare-ipc --unshare-uts --unshare-cgroup-try``: no System V IPC or host name shared;
- ``--ro-bind / /``: the whole file system read-only, with what may hold other users' data
  (/tmp, /var/tmp, /root, /home, /run, /dev/shm) hidden under empty tmpfs mounts, and the
  Python installation, the import paths and the tool's code that lie under them bound back
  read-only (never a home itself: ``_is_home``);
- ``--tmpfs /tmp`` of ``max_file_bytes`` and ``--chdir /tmp/work``: an empty work dir of its own;
- ``--new-session``: no terminal to inject keystrokes into;
- ``--cap-drop ALL`` (bwrap keeps a root caller's capabilities unless told) except CAP_SETUID
  and CAP_SETGID, which the runner uses once to become ``uid`` before any tool code runs;
- ``--seccomp FD``: no new user namespaces, no memfd, System V shm or POSIX message queue
  (``roles.tools.seccomp`` says why).

The runner then sets RLIMIT_CPU, RLIMIT_AS, RLIMIT_NPROC, RLIMIT_FSIZE and RLIMIT_NOFILE. Without bwrap the
same runner runs with the limits alone, in a fresh temporary directory (``choose_bwrap`` warns).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from roles.tools import seccomp

# Hidden from the tool: other users' and other jobs' files (temporary files, homes, sockets).
HIDDEN = ("/tmp", "/var/tmp", "/root", "/home", "/run", "/dev/shm")
WORK_DIR = "/tmp/work"
NAMESPACES = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try")
_BOOTSTRAP = ("import marshal, sys; job = marshal.loads(sys.stdin.buffer.read()); sys.path[:] = job['sys_path']; "
              "from roles.tools.runner import main; main(job)")
# What the runner may report (roles.tools.runner._kind); the executor adds its own kinds.
RUNNER_KINDS = ("crash", "memory", "network", "process_limit", "denied", "output_limit")
_STDERR_TAIL = 2000  # bytes of the tool's prints and traceback kept for the error message
# A uid no account uses, one per worker process (RLIMIT_NPROC counts the processes of a uid):
# above the ranges that directories (LDAP often starts at 100000) and systemd's containers
# (524288..1879048191) hand out, below 2**31.
UID_BASE = 0x7000_0000


@dataclass(frozen=True, kw_only=True)
class Limits:
    timeout_s: float  # wall clock, from start to answer
    cpu_seconds: int
    memory_bytes: int  # RLIMIT_AS: address space of each process
    max_processes: int  # RLIMIT_NPROC, counted for the sandbox's uid
    max_file_bytes: int  # RLIMIT_FSIZE, and the size of the tmpfs work dir
    max_output_chars: int  # the answer is cut here
    max_print_bytes: int = 1 << 20  # the tool's own prints (stdout and stderr) beyond this stop it


@dataclass(frozen=True, kw_only=True)
class Outcome:
    ok: bool
    text: str  # the answer, or what went wrong, in words for the model
    error_kind: str | None
    cut: int = 0  # the answer's full length in characters when it was cut to max_output_chars


def choose_bwrap() -> tuple[str | None, str | None]:
    """``(path of bwrap, None)`` when it runs here with every namespace flag, else ``(None,
    one-line warning)``: the calls then run with the resource limits only."""
    path = shutil.which("bwrap")
    fallback = "tool calls run WITHOUT network, PID and file-system isolation, with resource limits only"
    if path is None:
        return None, f"bwrap (bubblewrap) is not installed: {fallback}. Install it: apt-get install bubblewrap"
    with _seccomp_fd() as fd:
        flags = bwrap_flags(max_file_bytes=1 << 20, python=sys.executable, import_paths=(), seccomp_fd=fd)
        probe = subprocess.run([path, *flags, "true"], capture_output=True, text=True, pass_fds=_fds(fd))
    if probe.returncode != 0:
        reason = probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else f"exit code {probe.returncode}"
        return None, f"bwrap cannot sandbox here ({reason}): {fallback}"
    return path, None


def sandbox_uid() -> int | None:
    """The uid the calls of this process run as: root's own is exempt from RLIMIT_NPROC."""
    return UID_BASE + os.getpid() if os.geteuid() == 0 else None


def bwrap_flags(*, max_file_bytes: int, python: str, import_paths: tuple[str, ...], seccomp_fd: int | None) -> list[str]:
    flags = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", *NAMESPACES, "--die-with-parent",
             "--new-session", "--cap-drop", "ALL"]
    if seccomp_fd is not None:
        flags += ["--seccomp", str(seccomp_fd)]
    if os.geteuid() == 0:
        flags += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for hidden in HIDDEN:
        if os.path.isdir(hidden):
            size = ["--size", str(max_file_bytes)] if hidden in ("/tmp", "/dev/shm") else ["--size", "65536"]
            # /tmp and /dev/shm writable as on a host (multiprocessing's semaphores live in /dev/shm)
            flags += ["--perms", "1777" if hidden in ("/tmp", "/dev/shm") else "0755", *size, "--tmpfs", hidden]
    flags += ["--perms", "0777", "--dir", WORK_DIR]
    flags += _bind_back(_needed_paths(python, import_paths))
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK_DIR, "LANG": "C.UTF-8",
           # threads count against RLIMIT_NPROC: math libraries would start one per core of the host
           **{name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}}
    return [*flags, "--clearenv", *(word for name, value in env.items() for word in ("--setenv", name, value)),
            "--chdir", WORK_DIR, "--"]


def _needed_paths(python: str, import_paths: tuple[str, ...]) -> list[str]:
    """What the runner reads: the interpreter and its prefixes, the import paths, the tool's file."""
    paths = [os.path.dirname(os.path.realpath(python)), sys.base_prefix, sys.prefix, sys.exec_prefix, *import_paths]
    return sorted({os.path.realpath(p) for p in paths if os.path.exists(p)})


def _is_home(path: str) -> bool:
    """A home itself (``/home/NAME``; ``/root`` is a hidden directory itself): ``python -m`` run
    from a home puts it on sys.path, and binding it back would show its keys and tokens (~/.ssh,
    ~/.netrc, a Hugging Face token). What lies in it (a repo, a venv, the tool's file) is bound alone."""
    return os.path.dirname(path) == "/home"


def _bind_back(paths: list[str]) -> list[str]:
    flags, made, bound = [], set(), []
    for path in paths:  # sorted: a directory comes before what lies in it
        top = next((h for h in HIDDEN if path.startswith(h + "/")), None)
        if top is None or _is_home(path):  # visible already, or a hidden directory or home itself
            continue
        if any(path.startswith(b + "/") for b in bound):
            continue  # inside a directory bound back already
        bound.append(path)
        # bwrap makes missing parents 0700, which the sandbox's uid could not pass through
        parent = top
        for part in Path(path).relative_to(top).parts[:-1]:
            parent = f"{parent}/{part}"
            if parent not in made:
                flags += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        flags += ["--ro-bind", path, path]
    return flags


def run_call(*, bwrap: str | None, uid: int | None, limits: Limits, function_path: str, sys_path: list[str],
             name: str = "", arguments: dict | None = None, check: bool = False) -> Outcome:
    """Run one call of the tool function to its end, within ``limits``; never raises for what the tool does."""
    job = {"sys_path": sys_path, "function_path": function_path, "name": name, "arguments": arguments or {},
           "uid": uid, "check": check, "limits": asdict(limits)}
    python = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP]
    work_dir = None
    if bwrap is None:
        work_dir = tempfile.mkdtemp(prefix="tandem-tool-")
        os.chmod(work_dir, 0o777)  # the runner may become another uid
        job["uid"] = None  # no bind-back without bwrap: root's Python would become unreadable to another uid
    try:
        with _seccomp_fd() if bwrap is not None else contextlib.nullcontext() as fd:
            command = python
            if bwrap is not None:
                command = [bwrap, *bwrap_flags(max_file_bytes=limits.max_file_bytes, python=sys.executable,
                                               import_paths=(*sys_path, *_tool_paths(function_path, sys_path)),
                                               seccomp_fd=fd), *python]
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, cwd=work_dir, start_new_session=True,
                                       pass_fds=_fds(fd))
        return _finish(process, job, limits, sandboxed=bwrap is not None)
    finally:
        if work_dir is not None:
            shutil.rmtree(work_dir, ignore_errors=True)


@contextlib.contextmanager
def _seccomp_fd():
    """A pipe's read end holding seccomp.filter_program() for bwrap; None where it is not built."""
    if not seccomp.supported():
        yield None
        return
    read_fd, write_fd = os.pipe()
    try:
        os.write(write_fd, seccomp.filter_program())  # ~100 bytes: the pipe holds them
        os.close(write_fd)
        yield read_fd
    finally:
        os.close(read_fd)


def _fds(fd: int | None) -> tuple[int, ...]:
    return () if fd is None else (fd,)


def _tool_paths(function_path: str, sys_path: list[str]) -> tuple[str, ...]:
    """What holds the tool's code, which may lie in a folder not bound back (/tmp, a home on
    sys.path): a file named by path (``path/tools.py:execute``) or, for a module name, the file
    or package folder of its top-level package, found on ``sys_path`` without importing it."""
    location = function_path.rpartition(":")[0]
    if location.endswith(".py"):
        return (os.path.abspath(location),)
    spec = importlib.machinery.PathFinder.find_spec(location.partition(".")[0], sys_path)
    if spec is None:  # a built-in or frozen module, or one the sandbox will fail to load (and say so)
        return ()
    return tuple(spec.submodule_search_locations or ()) or ((spec.origin,) if spec.origin else ())


def _finish(process: subprocess.Popen, job: dict, limits: Limits, *, sandboxed: bool) -> Outcome:
    deadline = time.monotonic() + limits.timeout_s
    process.stdin.write(marshal.dumps(job))
    process.stdin.close()
    answer, prints, printed, stop = bytearray(), bytearray(), 0, None
    answer_cap = 4 * limits.max_output_chars + 4096  # an answer of max_output_chars, 4 UTF-8 bytes each, fits
    with selectors.DefaultSelector() as sel:
        sel.register(process.stdout, selectors.EVENT_READ)
        sel.register(process.stderr, selectors.EVENT_READ)
        while sel.get_map() and stop is None:
            left = deadline - time.monotonic()
            if left <= 0:
                stop = _timed_out(limits)
                break
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.fileobj is process.stdout:
                    answer += chunk
                    if len(answer) > answer_cap:
                        stop = _too_long(f"answered more than {answer_cap} bytes")
                else:
                    printed += len(chunk)
                    prints = (prints + chunk)[-_STDERR_TAIL:]
                    if printed > limits.max_print_bytes:
                        stop = _too_long(f"printed more than {limits.max_print_bytes} bytes")
    if stop is None:
        try:  # the pipes can close before the process ends (a tool that closes them and spins)
            code = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop = _timed_out(limits)
    if stop is not None:
        _kill(process)
        return stop
    return _outcome(code, bytes(answer), prints.decode(errors="replace"), limits, sandboxed)


def _timed_out(limits: Limits) -> Outcome:
    return Outcome(ok=False, error_kind="timeout",
                   text=f"error: the tool ran longer than {limits.timeout_s:g} s and was stopped")


def _too_long(what: str) -> Outcome:
    return Outcome(ok=False, error_kind="output_limit", text=f"error: the tool {what} and was stopped")


def _kill(process: subprocess.Popen) -> None:
    # The process is bwrap (whose PID namespace dies with it) or, without bwrap, the runner in
    # a session of its own: its whole process group goes.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    for pipe in (process.stdout, process.stderr):
        pipe.close()


def _outcome(code: int, answer: bytes, prints: str, limits: Limits, sandboxed: bool) -> Outcome:
    # The runner's "ok\nCUT\nTEXT" or "error\nKIND\nMESSAGE"; the tool could forge one, so it is checked.
    status, _, rest = answer.partition(b"\n")
    detail, _, text = rest.partition(b"\n")
    if status == b"ok" and detail.isdigit():
        return Outcome(ok=True, text=text.decode(errors="replace"), error_kind=None, cut=int(detail))
    if status == b"error":
        kind = detail.decode(errors="replace")
        return Outcome(ok=False, error_kind=kind if kind in RUNNER_KINDS else "crash",
                       text=f"error: {text.decode(errors='replace')}")
    return _death(code, prints, limits, sandboxed)


def _death(code: int, prints: str, limits: Limits, sandboxed: bool) -> Outcome:
    """The runner ended without an answer: killed by a limit, or the tool exited on its own."""
    if sandboxed and code < 0:  # bwrap itself was killed, from outside: what runs under it ends as 128 + signal
        return Outcome(ok=False, error_kind="crash",
                       text=f"error: the tool's sandbox was killed by {signal.Signals(-code).name} without an answer")
    # bwrap exits with 128 + the signal that killed the command; without bwrap Popen says -signal
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig in (signal.SIGXCPU, signal.SIGKILL) and "MemoryError" not in prints:
        # SIGKILL: the hard CPU limit, one second after SIGXCPU was ignored (or the OOM killer)
        return Outcome(ok=False, error_kind="timeout",
                       text=f"error: the tool used more than {limits.cpu_seconds} s of CPU time and was stopped")
    if "MemoryError" in prints:
        return Outcome(ok=False, error_kind="memory",
                       text=f"error: the tool ran out of its {limits.memory_bytes >> 20} MiB of memory")
    if sig == signal.SIGXFSZ:
        return Outcome(ok=False, error_kind="output_limit",
                       text=f"error: the tool wrote a file of more than {limits.max_file_bytes} bytes")
    how = f"was killed by {signal.Signals(sig).name}" if sig in signal.Signals._value2member_map_ \
        else f"exited with code {code}"
    tail = prints.strip().splitlines()[-1] if prints.strip() else "no message"
    return Outcome(ok=False, error_kind="crash", text=f"error: the tool {how} without an answer ({tail})")
