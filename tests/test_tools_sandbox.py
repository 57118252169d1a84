"""The tool sandbox for real: ``ToolExecutor`` on worker processes, each call under bubblewrap
with its resource limits (skipped where bwrap cannot sandbox: not installed, or refused
namespaces, as in Docker's default profile; the executor would then run these misdeeds
unsandboxed). A tool that hangs, crashes, forks without end, writes gigabytes, reaches for the
network or outside its work dir gets an error result with its error kind, and the executor keeps serving; a killed worker is replaced and the
call in flight is answered once."""

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from roles.tools import sandbox
from roles.tools.executor import ToolExecutor
from roles.tools.result import ERROR_KINDS
from roles.tools.sandbox import Limits
from roles.tools.specs import ToolSet, load_tools

# The executor's own probe: where it fails the executor falls back, and a fork bomb or a write to /
# would run for real, as root on CI.
BWRAP, NO_SANDBOX = sandbox.choose_bwrap()
pytestmark = pytest.mark.skipif(BWRAP is None, reason=f"{NO_SANDBOX} (.ci/run says so)")

LIMITS = Limits(timeout_s=2.0, cpu_seconds=1, memory_bytes=256 << 20, max_processes=16, max_file_bytes=4 << 20,
                max_output_chars=1000)
SECRET = "the host's secret"

# A tool that misbehaves as it is asked to. It lives in the host's /tmp, which the sandbox
# hides: the executor binds this one file back, read-only.
TOOL = '''
import json, os, socket, time

def execute(name, arguments):
    what = arguments["what"]
    if what == "echo":
        return arguments.get("text", "")
    if what == "slow_echo":
        time.sleep(1.0)
        return arguments.get("text", "")
    if what == "hang":
        while True:
            pass
    if what == "sleep":
        time.sleep(60)
    if what == "crash":
        raise RuntimeError("boom")
    if what == "exit":
        os._exit(3)
    if what == "memory":
        return str(len(bytearray(2 << 30)))
    if what == "fork":
        while True:
            os.fork()
    if what == "big_file":
        with open("big", "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
    if what == "big_answer":
        return "y" * 10_000_000
    if what == "prints":
        while True:
            print("z" * 10_000)
    if what == "network":
        socket.create_connection(("1.1.1.1", 80), timeout=1)
        return "connected"
    if what == "dns":
        return str(socket.getaddrinfo("example.com", 80))
    if what == "read":
        return open(arguments["text"]).read()
    if what == "write_root":
        open("/tandem-sandbox-test", "w").write("x")
        return "wrote"
    if what == "user_namespace":  # would hold every capability there, and mount a tmpfs no limit covers
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER)")
        return "a user namespace of its own"
    if what == "memfd":  # memory that RLIMIT_AS does not count while unmapped (RLIMIT_FSIZE holds each, not many)
        fd = os.memfd_create("held")
        os.ftruncate(fd, 1 << 20)
        return "a memfd of 1 MiB"
    if what == "shm":  # a System V segment: the same, and it outlives its process
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.shmget(0, ctypes.c_size_t(64 << 20), 0o1600) < 0:  # IPC_PRIVATE, IPC_CREAT | 0600
            raise OSError(ctypes.get_errno(), "shmget")
        return "a shm segment of 64 MiB"
    if what == "files":
        held = [open("/dev/null") for _ in range(1000)]
        return f"{len(held)} files open"
    if what == "inside":
        import subprocess, threading
        ran = []
        thread = threading.Thread(target=lambda: ran.append(1))  # clone3 refused: glibc falls back to clone
        thread.start()
        thread.join()
        child = subprocess.run(["echo", "child"], capture_output=True, text=True).stdout.strip()
        return json.dumps({"uid": os.getuid(), "pid": os.getpid(), "cwd": os.getcwd(), "files": os.listdir("."),
                           "tmp": sorted(os.listdir("/tmp")), "thread": ran == [1], "child": child, "net": sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:])})
    return "unknown"
'''
SPECS = ({"type": "function", "function": {"name": "misbehave", "parameters": {
    "type": "object", "properties": {"what": {"type": "string"}, "text": {"type": "string"}}, "required": ["what"]}}},)


@contextlib.contextmanager
def in_host_tmp():
    """A folder in the host's /tmp, which the sandbox hides, wherever TMPDIR puts pytest's tmp_path
    (elsewhere it is not hidden, and in root's 0700 pytest-of-root not readable by the sandbox's uid)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="tandem-sandbox-test-") as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def tool_file():
    with in_host_tmp() as folder:
        path = folder / "misbehave.py"
        path.write_text(TOOL)
        yield path


@pytest.fixture
def host_tmp():
    with in_host_tmp() as folder:
        yield folder


@pytest.fixture(scope="module")
def executor(tool_file):
    ex = ToolExecutor(ToolSet(specs=SPECS, function_path=f"{tool_file}:execute"), LIMITS, num_workers=2)
    yield ex
    pids = [w.process.pid for w in ex._workers]
    ex.close()
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def call(ex: ToolExecutor, what: str, text: str = ""):
    return asyncio.run(ex.call("misbehave", {"what": what, "text": text}))


# what the tool does -> its error kind; the first two are the timed ones (see below)
MISDEEDS = {
    "hang": "timeout",  # RLIMIT_CPU: SIGXCPU after 1 s of CPU
    "sleep": "timeout",  # the wall clock: 2 s
    "crash": "crash",
    "exit": "crash",
    "memory": "memory",  # RLIMIT_AS
    "fork": "process_limit",  # RLIMIT_NPROC, for the sandbox's own uid
    "big_file": "output_limit",  # the 4 MiB tmpfs / RLIMIT_FSIZE
    "big_answer": "output_limit",  # cut at 1000 characters
    "prints": "output_limit",  # more than 1 MiB of prints
    "network": "network",
    "dns": "network",
    "write_root": "denied",  # the root is read-only
    "user_namespace": "denied",  # the seccomp filter
    "memfd": "denied",  # the seccomp filter: RLIMIT_AS does not count it
    "shm": "denied",  # the same
    "files": "crash",  # RLIMIT_NOFILE: EMFILE
}


@pytest.mark.timeout(90)
def test_each_misdeed_gets_its_error_kind_and_the_executor_keeps_serving(executor):
    before = executor.stats()

    async def run_all():
        return await asyncio.gather(*(executor.call("misbehave", {"what": w}) for w in MISDEEDS))

    results = dict(zip(MISDEEDS, asyncio.run(run_all())))
    for what, kind in MISDEEDS.items():
        r = results[what]
        assert (r.ok, r.error_kind) == (False, kind), (what, r)
        assert r.text.startswith("error: ") or what == "big_answer", (what, r.text)
    # Stopped at their limits, not by the executor's stuck-worker grace (timeout + 10 s). Only the
    # first two calls are timed: they take the two idle workers at once, while a later call's
    # seconds include its wait for a worker, which on a busy 2-core box can pass any fixed bound.
    assert list(MISDEEDS)[:2] == ["hang", "sleep"]
    for what in ("hang", "sleep"):
        assert results[what].seconds < LIMITS.timeout_s + 5, results[what]
    assert "Too many open files" in results["files"].text
    assert results["big_answer"].text.startswith("y" * 1000 + "\n[output cut: 10000000 characters")
    assert call(executor, "echo", "still here").text == "still here"
    after = executor.stats()
    assert after["tool_calls"] - before["tool_calls"] == len(MISDEEDS) + 1
    assert after["tool_errors"] - before["tool_errors"] == len(MISDEEDS)
    assert after["tool_timeouts"] - before["tool_timeouts"] == 2
    for kind in set(MISDEEDS.values()):
        assert after[f"tool_errors/{kind}"] - before[f"tool_errors/{kind}"] == list(MISDEEDS.values()).count(kind)
    assert after["tool_worker_restarts"] == before["tool_worker_restarts"]  # the workers survive every misdeed
    assert after["tool_seconds"] > before["tool_seconds"]


@pytest.mark.timeout(60)
def test_a_call_sees_an_empty_work_dir_no_network_its_own_pids_and_not_root(executor, tool_file):
    import json

    inside = json.loads(call(executor, "inside").text)
    assert inside["cwd"] == sandbox.WORK_DIR and inside["files"] == []
    assert inside["net"] == ["lo"]  # a network namespace of its own
    assert inside["pid"] < 10  # a PID namespace of its own
    assert inside["thread"] and inside["child"] == "child"  # threads and subprocesses work under the filter
    assert inside["tmp"] == sorted([tool_file.parts[2], "work"])  # the host's /tmp is hidden, the tool bound back
    if os.geteuid() == 0:
        assert inside["uid"] >= sandbox.UID_BASE  # no longer root: RLIMIT_NPROC holds, capabilities are gone


@pytest.mark.timeout(60)
def test_files_outside_the_work_dir_stay_out_of_reach(executor, host_tmp):
    secret = host_tmp / "secret.txt"  # on the host's /tmp, hidden in the sandbox
    secret.write_text(SECRET)
    r = call(executor, "read", str(secret))
    assert (r.ok, r.error_kind) == (False, "crash") and "FileNotFoundError" in r.text and SECRET not in r.text
    if os.geteuid() == 0:  # a file only root may read, in a directory the sandbox shows
        r = call(executor, "read", "/etc/shadow")
        assert (r.ok, r.error_kind) == (False, "denied"), r
    assert not os.path.exists("/tandem-sandbox-test")


@pytest.mark.timeout(60)
def test_unknown_tools_and_bad_arguments_are_answered_without_a_sandbox(executor):
    before = executor.stats()
    for name, arguments, kind in (("nope", {"what": "echo"}, "unknown_tool"), ("misbehave", {}, "bad_arguments"),
                                  ("misbehave", {"what": 3}, "bad_arguments"), ("misbehave", [1], "bad_arguments")):
        r = asyncio.run(executor.call(name, arguments))
        assert (r.ok, r.error_kind, r.seconds) == (False, kind, 0.0), r
    assert executor.stats()["tool_calls"] - before["tool_calls"] == 4


@pytest.mark.timeout(60)
def test_a_worker_killed_under_a_call_is_replaced_and_the_call_answered_once(tool_file):
    ex = ToolExecutor(ToolSet(specs=SPECS, function_path=f"{tool_file}:execute"), LIMITS, num_workers=1)
    try:
        async def kill_during_call():
            task = asyncio.ensure_future(ex.call("misbehave", {"what": "slow_echo", "text": "done"}))
            await asyncio.sleep(0.4)  # the call is in its sandbox now
            os.kill(ex._workers[0].process.pid, signal.SIGKILL)
            return await task

        result = asyncio.run(kill_during_call())
        assert (result.ok, result.text) == (True, "done")  # run again on the replacement
        stats = ex.stats()
        assert (stats["tool_calls"], stats["tool_errors"], stats["tool_worker_restarts"]) == (1, 0, 1)
        os.kill(ex._workers[0].process.pid, signal.SIGKILL)  # dies while idle: found at the next call
        time.sleep(0.1)
        assert call(ex, "echo", "again").text == "again"
        assert ex.stats()["tool_worker_restarts"] == 2 and ex.stats()["tool_calls"] == 2
    finally:
        ex.close()


@pytest.mark.timeout(60)
def test_a_tool_module_the_sandbox_cannot_import_fails_at_start(host_tmp):
    elsewhere = host_tmp / "data.txt"  # readable here, hidden in the sandbox
    elsewhere.write_text("x")
    tool = host_tmp / "reads_at_import.py"
    tool.write_text(f"DATA = open({str(elsewhere)!r}).read()\ndef execute(name, arguments):\n    return DATA\n")
    tools = ToolSet(specs=SPECS, function_path=f"{tool}:execute")
    with pytest.raises(ValueError, match="^--generate-execute-tool-function-path .*did not load in the sandbox: "
                                         "FileNotFoundError"):
        ToolExecutor(tools, LIMITS, num_workers=1)


@pytest.mark.timeout(60)
def test_the_calculator_runs_in_the_sandbox():
    tools = load_tools("roles.tools.calculator:TOOL_SPECS", "roles.tools.calculator:execute_tool")
    ex = ToolExecutor(tools, LIMITS, num_workers=1)
    try:
        assert ex.sandboxed and ex.warning is None
        r = asyncio.run(ex.call("calculator", {"expression": "123456789 * 987654321 + 1"}))
        assert (r.ok, r.text, r.error_kind) == (True, str(123456789 * 987654321 + 1), None)
        assert asyncio.run(ex.call("calculator", {"expression": "1/0"})).text == "error: division by zero"
    finally:
        ex.close()


def test_error_kinds_are_the_documented_ones():
    docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "tools.md")).read()
    assert all(f"`{kind}`" in docs for kind in ERROR_KINDS)


@pytest.mark.timeout(60)
def test_close_under_calls_fails_them_and_starts_no_worker():
    tools = load_tools("roles.tools.calculator:TOOL_SPECS", "roles.tools.calculator:execute_tool")
    ex = ToolExecutor(tools, LIMITS, num_workers=2)

    async def close_under_calls():
        calls = [asyncio.ensure_future(ex.call("calculator", {"expression": "1+1"})) for _ in range(6)]
        await asyncio.sleep(0.05)
        ex.close()
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(close_under_calls())
    assert all(isinstance(o, (RuntimeError, asyncio.CancelledError)) or o.ok for o in outcomes), outcomes
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(ex.call("calculator", {"expression": "1+1"}))
    # the autouse no_orphans fixture (tests/conftest.py) checks that no worker or sandbox is left
