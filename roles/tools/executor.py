"""``ToolExecutor``: ``await executor.call(name, arguments) -> ToolResult``, served by a pool of
tool worker processes (``roles.tools.worker``), each call in a sandbox of its own.

Supervision follows the reward scorer's pool (roles/reward/pool.py): workers are plain
``subprocess`` children with pipes, started and checked before the first call; a worker that
dies is replaced and counted (``tool_worker_restarts``). The call it was running is sent once
more to the replacement (a sandbox keeps nothing between calls, so running a call again
is safe), and answered with ``error_kind="worker_lost"`` if that worker dies too, or if no
replacement starts (the dead worker then stays in the pool, replaced at its next call). Every
call is counted once, whatever happened to its workers; ``call`` never raises for them.

The calls block on pipes in threads of the executor's own (one per worker), so ``call`` works
from any event loop, including a new one per rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from queue import SimpleQueue

from roles.tools.result import ToolResult, count, cut_result, new_counts
from roles.tools.sandbox import Limits, choose_bwrap
from roles.tools.specs import ToolSet

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_STARTUP_TIMEOUT_S = 60.0
_ANSWER_GRACE_S = 10.0  # the worker stops a call at its timeout; past this it is stuck itself


class WorkerLost(RuntimeError):
    pass


class _Worker:
    def __init__(self, setup: dict):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen([sys.executable, "-m", "roles.tools.worker", str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            self._send(setup)
            ready = self.receive(_STARTUP_TIMEOUT_S)
        except BaseException:  # died while starting (WorkerLost): no zombie, no open pipes
            self.kill()
            raise
        if ready is None or not ready.get("ready"):
            self.kill()
            raise RuntimeError(f"a tool worker did not start within {_STARTUP_TIMEOUT_S} s")

    def exchange(self, job: dict, timeout: float) -> dict | None:
        """The worker's answer to ``job``; None if none came within ``timeout``; WorkerLost if it died."""
        self._send(job)
        return self.receive(timeout)

    def receive(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        if not line.endswith(b"\n"):  # nothing, or half a line: it died, perhaps while writing
            raise WorkerLost(f"tool worker {self.process.pid} exited with code {self.process.wait()}")
        return json.loads(line)

    def _send(self, message: dict) -> None:
        try:
            self.process.stdin.write(json.dumps(message).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise WorkerLost(f"tool worker {self.process.pid} is gone") from None

    def kill(self) -> None:
        _kill(self.process)


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout):
        try:
            pipe.close()
        except BrokenPipeError:
            pass


class ToolExecutor:
    """Runs the calls of ``tools`` on ``num_workers`` worker processes, each call within ``limits``."""

    def __init__(self, tools: ToolSet, limits: Limits, *, num_workers: int, sys_path: list[str] | None = None):
        bwrap, self.warning = choose_bwrap()
        if self.warning:
            print(f"tandem: warning: {self.warning}", file=sys.stderr)  # never silently without the sandbox
        self.sandboxed = bwrap is not None
        self._tools = tools
        self._limits = limits
        self._setup = {"bwrap": bwrap, "limits": asdict(limits), "function_path": tools.function_path,
                       "sys_path": list(sys.path if sys_path is None else sys_path)}
        self._lock = threading.Lock()
        self._counts = new_counts()
        self._workers: list[_Worker] = []
        self._processes: list[subprocess.Popen] = []  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _kill_all, self._processes)
        self._idle: SimpleQueue[_Worker] = SimpleQueue()
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="tool-call")
        self._next_id = 0
        self._closed = False
        try:
            for _ in range(num_workers):
                self._add_worker()
            self._check_function()
        except BaseException:
            self.close()
            raise

    async def call(self, name: str, arguments: dict) -> ToolResult:
        """Run one tool call; every failure is a ToolResult with ``ok=False``, never an exception."""
        if self._closed:
            raise RuntimeError("the tool executor is closed")
        start = time.monotonic()
        problem = self._tools.argument_problem(name, arguments)
        if problem is not None:
            kind, text = problem
            return self._count(ToolResult(text=f"error: {text}", ok=False, error_kind=kind, seconds=0.0))
        # Counted in the thread: a call whose awaiting task is cancelled still runs to its end, and counts.
        return await asyncio.get_running_loop().run_in_executor(self._threads, self._call, name, arguments, start)

    def stats(self) -> dict:
        """Counters since start (roles.tools.result.count): ``tool_calls``, ``tool_errors``,
        ``tool_errors/KIND``, ``tool_timeouts``, ``tool_seconds`` (summed over calls), ``tool_worker_restarts``."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        """Stop the workers (their sandboxes die with them); the executor cannot be used afterwards."""
        with self._lock:
            self._closed = True
            workers = list(self._workers)
        self._threads.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()
        self._finalizer.detach()

    def _add_worker(self) -> _Worker:
        worker = _Worker(self._setup)
        self._workers.append(worker)
        self._processes.append(worker.process)
        self._idle.put(worker)
        return worker

    def _check_function(self) -> None:
        # The function imports in this process (ppo checks that before any role starts); this
        # checks that it also imports inside the sandbox, where /tmp and the homes are hidden.
        answer = self._run("", {}, True)
        if not answer["ok"]:
            raise ValueError(f"--generate-execute-tool-function-path {self._tools.function_path}: "
                             f"{answer['text'].removeprefix('error: ')}")

    def _call(self, name: str, arguments: dict, start: float) -> ToolResult:
        answer = self._run(name, arguments, False)
        return self._count(self._result(answer, time.monotonic() - start))

    def _run(self, name: str, arguments: dict, check: bool) -> dict:
        """The worker's answer, with ``worker_restarts``: the workers replaced on the way."""
        worker, restarts = self._idle.get(), 0
        try:
            with self._lock:
                self._next_id += 1
                job = {"id": self._next_id, "name": name, "arguments": arguments, "check": check}
            for attempt in range(2):  # once more on a new worker if this one dies under the call
                try:
                    answer = worker.exchange(job, self._limits.timeout_s + _ANSWER_GRACE_S)
                except (WorkerLost, ValueError) as lost:  # ValueError: close() shut its pipes under us
                    restarts += 1
                    try:
                        worker = self._replace(worker)  # RuntimeError if close() did
                    except WorkerLost as failed:  # the dead worker stays in the pool: replaced at its next call
                        return _lost(f"the tool's worker died during this call ({lost}), and {failed}", restarts)
                    if attempt == 1:
                        return _lost(f"the tool's worker died twice during this call ({lost})", restarts)
                    continue
                if answer is None:  # the worker itself hangs: the call cannot be trusted to end
                    restarts += 1
                    with contextlib.suppress(WorkerLost):  # killed; without a replacement, replaced at its next call
                        worker = self._replace(worker)
                    return {"ok": False, "error_kind": "timeout", "cut": 0, "worker_restarts": restarts,
                            "text": f"error: the tool ran longer than {self._limits.timeout_s:g} s and was stopped"}
                return {**answer, "worker_restarts": restarts}
        finally:
            self._idle.put(worker)

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        with self._lock:
            if self._closed:  # close() killed it under the call: start nothing new
                raise RuntimeError("the tool executor was closed during the call")
            i = self._workers.index(worker)
        try:
            replacement = _Worker(self._setup)
        except (RuntimeError, OSError) as e:  # WorkerLost is one: it died while starting
            raise WorkerLost(f"its replacement did not start ({e})") from e
        with self._lock:
            if not self._closed:
                self._workers[i] = replacement
                self._processes[i] = replacement.process
                return replacement
        replacement.kill()  # close() came while it started, and did not see it
        raise RuntimeError("the tool executor was closed during the call")

    def _result(self, answer: dict, seconds: float) -> ToolResult:
        if answer["ok"] and answer["cut"]:
            return cut_result(answer["text"], answer["cut"], self._limits.max_output_chars, seconds,
                              answer["worker_restarts"])
        return ToolResult(text=answer["text"], ok=answer["ok"], error_kind=answer["error_kind"], seconds=seconds,
                          worker_restarts=answer["worker_restarts"])

    def _count(self, result: ToolResult) -> ToolResult:
        with self._lock:
            count(self._counts, result)
        return result


def _lost(why: str, restarts: int) -> dict:
    return {"ok": False, "error_kind": "worker_lost", "cut": 0, "text": f"error: {why}", "worker_restarts": restarts}


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        _kill(process)
