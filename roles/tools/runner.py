"""Runs one tool call inside the sandbox (a fresh ``python -I -S`` under bwrap, one per call).

Started by ``roles.tools.sandbox`` with the job, marshalled, on stdin: ``{"sys_path",
"function_path", "name", "arguments", "uid", "limits": {...}, "check": bool}`` (marshal, not
json: importing json and the re module it needs costs each call more than the rest of the
start-up). In order: the tool's own prints go to stderr (stdout carries only the answer); as
root, the process takes the uid it is given, which drops every capability and makes
RLIMIT_NPROC count (root is exempt from it); the resource limits (RLIMIT_NOFILE too) are set, soft = hard so
they cannot be raised; only then is the user's module imported and called. The answer, on
the saved stdout, is ``ok\nCUT\nTEXT`` (CUT: the text's full length when it was cut, else 0)
or ``error\nKIND\nMESSAGE``, UTF-8.

``check`` only loads the function and checks its signature: the executor's first call, so
that a module the sandbox cannot import fails at start, not at the first tool call.
"""

import errno
import os
import resource
import sys
from collections.abc import Awaitable

from roles.reward.custom import describe, load_function

_NETWORK = {errno.ENETUNREACH, errno.EHOSTUNREACH, errno.ENETDOWN, errno.EADDRNOTAVAIL}
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}
_DISK = {errno.EFBIG, errno.ENOSPC, errno.EDQUOT}
# Open files of each process: Python needs a dozen; inherited, it would be the host's (often tens of thousands)
MAX_OPEN_FILES = 256


def main(job: dict) -> None:
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    _drop_privileges(job["uid"])
    _limit(job["limits"])
    pid = os.getpid()
    answer = _answer(job)
    if os.getpid() != pid:  # a process the tool forked came back here: only the runner answers
        os._exit(0)
    with os.fdopen(answer_fd, "wb") as out:
        out.write("\n".join(map(str, answer)).encode(errors="replace"))


def _drop_privileges(uid: int | None) -> None:
    if uid is None:  # not root: bwrap already runs us as the user, in a user namespace
        return
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # from uid 0 to another: the kernel clears every capability


def _limit(limits: dict) -> None:
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU, then SIGKILL a second later
    for name, key in (("RLIMIT_AS", "memory_bytes"), ("RLIMIT_NPROC", "max_processes"),
                      ("RLIMIT_FSIZE", "max_file_bytes")):
        resource.setrlimit(getattr(resource, name), (limits[key], limits[key]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (MAX_OPEN_FILES, MAX_OPEN_FILES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _answer(job: dict) -> tuple[str, int | str, str]:
    sys.path[:] = job["sys_path"]
    try:
        function = load_function(job["function_path"], "generate_execute_tool_function_path")
        if job["check"]:  # inspect costs a call ~50 ms of imports: only the first call checks
            from roles.tools.specs import check_tool_function

            check_tool_function(function, job["function_path"])
            return "ok", 0, ""
    except BaseException as e:
        return "error", "crash", f"the tool function did not load in the sandbox: {describe(e)}"
    try:
        text = function(job["name"], job["arguments"])
        if isinstance(text, Awaitable):
            import asyncio  # only for an async function: it costs the others start-up time

            text = asyncio.new_event_loop().run_until_complete(text)
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the call failed, the answer still goes back
        return "error", error_kind(e), describe(e)
    if not isinstance(text, str):
        return "error", "crash", f"the tool function returned a {type(text).__name__}, not a str"
    limit = job["limits"]["max_output_chars"]
    return "ok", len(text) if len(text) > limit else 0, text[:limit]


def error_kind(error: BaseException) -> str:
    """The error kind of an exception the tool raised (docs/tools.md lists them)."""
    if isinstance(error, MemoryError):
        return "memory"
    socket = sys.modules.get("socket")  # a name-lookup error comes from a tool that imported it
    if socket is not None and isinstance(error, socket.gaierror):
        return "network"
    if isinstance(error, OSError):
        if error.errno == errno.EAGAIN:  # uncaught EAGAIN: fork or thread refused by RLIMIT_NPROC
            return "process_limit"
        if error.errno in _NETWORK:
            return "network"
        if error.errno in _DENIED:
            return "denied"
        if error.errno in _DISK:
            return "output_limit"
    return "crash"

