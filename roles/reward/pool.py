"""A pool of reward worker processes that kills and replaces a worker whose job hangs.

Why processes and not threads: a reward job can hang for good — sympy simplifying a
tower of powers, bignum arithmetic that holds the GIL, a user function waiting on a
dead server. A Python thread cannot be stopped; one that is abandoned keeps burning a
core (and, in C code, the GIL) for the rest of the run, so a thread pool that "replaces"
hung threads slowly chokes the scorer. ``signal.alarm`` works only in the main thread
and cannot interrupt C code either. A process can always be SIGKILLed, and starting a
replacement costs about half a second, which a rare hang can afford.

Latency: workers are started (and import sympy) before the first batch, each keeps one
job in flight, and a job is a pickled sample dict over a pipe (~0.1 ms round trip), so
a small batch costs little more than the rule itself.

Workers are plain ``subprocess`` children rather than ``multiprocessing`` ones: a
daemonic process (which a role process may well be) may not start multiprocessing
children, and the user's prints go to the scorer's stdout instead of a pipe.
"""

import os
import subprocess
import sys
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from roles.reward.worker import JobConfig

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
_STARTUP_TIMEOUT_S = 60.0
_WORKER_MAIN = "import sys; from roles.reward.worker import main; main(*map(int, sys.argv[1:]))"


@dataclass(kw_only=True, frozen=True)
class JobResult:
    status: str  # "ok" | "error" | "timeout"
    value: float | list[float] | None = None
    error: str | None = None


class _Worker:
    def __init__(self, config: JobConfig):
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        args = [str(to_worker_r), str(from_worker_w), str(os.getpid())]
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_MAIN, *args],
            pass_fds=(to_worker_r, from_worker_w),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        os.close(to_worker_r)
        os.close(from_worker_w)
        self.inbox = Connection(from_worker_r, writable=False)
        self.outbox = Connection(to_worker_w, readable=False)
        self.outbox.send(config)
        self.ready = False
        self.startup_deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        self.job: int | None = None  # index of the payload in flight
        self.deadline = 0.0

    def kill(self) -> None:
        _kill(self.process)
        self.inbox.close()
        self.outbox.close()


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


class WorkerPool:
    """Runs reward jobs on ``num_workers`` processes, each job under ``timeout_s``."""

    def __init__(self, config: JobConfig, *, num_workers: int, timeout_s: float):
        self._config = config
        self._timeout_s = timeout_s
        self._workers = [_Worker(config) for _ in range(num_workers)]
        self._processes = [w.process for w in self._workers]  # shared with the finalizer
        self._finalizer = weakref.finalize(self, _kill_all, self._processes)
        self.num_restarts = 0
        self._closed = False
        self._guarded_run([], until_ready=True)  # a broken config fails here, not at the first batch

    def run(self, payloads: list) -> list[JobResult]:
        """One result per payload, in order. Raises RuntimeError only if workers cannot start."""
        return self._guarded_run(payloads, until_ready=False)

    def stats(self) -> dict:
        return {"num_worker_restarts": self.num_restarts}

    def _guarded_run(self, payloads: list, *, until_ready: bool) -> list[JobResult]:
        if self._closed:
            raise RuntimeError("the reward worker pool is closed")
        try:
            return self._run(payloads, until_ready)
        except BaseException:
            self.close()  # in-flight jobs would answer into the next run: start over instead
            raise

    def _run(self, payloads: list, until_ready: bool) -> list[JobResult]:
        results: list[JobResult | None] = [None] * len(payloads)
        queue = deque(range(len(payloads)))
        # A replacement worker may still be starting when the last result is in: the call
        # returns anyway, and the worker's "ready" is read at the start of the next call.
        while (
            queue
            or any(w.job is not None for w in self._workers)
            or (until_ready and not all(w.ready for w in self._workers))
        ):
            self._dispatch(queue, payloads)
            waiting = [w for w in self._workers if w.job is not None or not w.ready]
            deadlines = [w.deadline if w.ready else w.startup_deadline for w in waiting]
            for conn in wait([w.inbox for w in waiting], timeout=max(0.0, min(deadlines) - time.monotonic())):
                self._receive(next(w for w in waiting if w.inbox is conn), results, queue)
            self._expire(results)
        return results

    def _dispatch(self, queue: deque, payloads: list) -> None:
        for i, worker in enumerate(self._workers):
            if not queue or not worker.ready or worker.job is not None:
                continue
            job = queue.popleft()
            try:
                worker.outbox.send((job, payloads[job]))
            except (BrokenPipeError, ConnectionResetError):
                queue.appendleft(job)  # it died while idle: not the job's fault
                self._replace(i)
                continue
            worker.job = job
            worker.deadline = time.monotonic() + self._timeout_s

    def _receive(self, worker: _Worker, results: list, queue: deque) -> None:
        i = self._workers.index(worker)
        try:
            message = worker.inbox.recv()
        except (EOFError, ConnectionResetError):
            code = worker.process.wait()
            if not worker.ready:
                raise RuntimeError(f"a reward worker exited with code {code} while starting") from None
            if worker.job is not None:
                results[worker.job] = JobResult(status="error", error=f"reward worker exited with code {code}")
            self._replace(i)
            return
        if message[0] == "ready":
            worker.ready = True
        elif message[0] == "startup_error":
            raise RuntimeError(f"a reward worker could not start: {message[1]}")
        else:
            job, status, value = message
            if status == "ok":
                results[job] = JobResult(status="ok", value=value)
            else:
                results[job] = JobResult(status=status, error=value)
            worker.job = None

    def _expire(self, results: list) -> None:
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            if worker.ready and worker.job is not None and now >= worker.deadline:
                results[worker.job] = JobResult(status="timeout", error=f"no reward within {self._timeout_s} s")
                self._replace(i)
            elif not worker.ready and now >= worker.startup_deadline:
                raise RuntimeError(f"a reward worker did not start within {_STARTUP_TIMEOUT_S} s")

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._config)
        self._processes[i] = self._workers[i].process
        self.num_restarts += 1

    def close(self) -> None:
        """Kill every worker; the pool cannot be used afterwards."""
        self._closed = True
        for worker in self._workers:
            worker.kill()
        self._finalizer.detach()


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        _kill(process)
