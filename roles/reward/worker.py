"""One reward worker process: evaluates scoring jobs sent by ``pool.WorkerPool``.

Started by the pool as ``main(read_fd, write_fd, parent_pid)`` in a fresh interpreter.
Messages are pickled over two pipes (parent and worker are the same program, so pickle
is safe here; nothing from outside reaches these pipes). The first message is the ``JobConfig``; the
worker answers ``("ready",)`` or ``("startup_error", text)``. Each job ``(job_id,
payload)`` is answered ``(job_id, "ok", value)`` or ``(job_id, "error", text)``.
"""

import asyncio
import ctypes
import inspect
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from roles.reward.custom import describe, load_reward_function
from roles.reward.values import reward_value

_PR_SET_PDEATHSIG = 1


@dataclass(kw_only=True, frozen=True)
class JobConfig:
    rm_type: str
    custom_rm_path: str | None
    group_rm: bool
    reward_key: str | None = None  # a function that returns dicts: the key of the reward (values.reward_value)
    sys_path: tuple[str, ...]  # the parent's, so custom modules import the same way


class JobEvaluator:
    """Computes one job: a sample dict -> float, or (group mode) a list of sample dicts -> list of floats.

    Usable in-process too; the worker process exists only so that a hung job can be killed.
    """

    def __init__(self, config: JobConfig):
        self._config = config
        self._function = None
        self._rules = {}
        if config.custom_rm_path:
            self._function = load_reward_function(config.custom_rm_path)
        else:
            # Imported only here: the rules pull in sympy, which a custom function's
            # worker does not need, and a worker restart should be quick.
            from roles.reward.rules import REWARD_RULES

            self._rules = REWARD_RULES
        # One loop for the worker's life, so an async reward function may keep a client
        # session (e.g. aiohttp) across calls.
        self._loop = asyncio.new_event_loop()

    def __call__(self, payload: dict | list[dict]) -> float | list[float]:
        if self._function is None:
            return self._rule_reward(payload)
        result = self._resolve(self._function(payload))
        if not self._config.group_rm:
            return self._reward(result)
        if not isinstance(result, (list, tuple)) or len(result) != len(payload):
            got = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
            raise TypeError(
                f"group reward function {self._config.custom_rm_path!r} must return one reward per sample "
                f"({len(payload)} floats), got {got}"
            )
        return [self._reward(value) for value in result]

    def _reward(self, result) -> float:
        return reward_value(result, self._config.reward_key, f"reward function {self._config.custom_rm_path!r}")

    def _rule_reward(self, sample: dict) -> float:
        # As in miles, a sample's metadata may name its own rule (mixed-task datasets).
        rm_type = sample["metadata"].get("rm_type") or self._config.rm_type
        rule = self._rules.get(rm_type)
        if rule is None:
            raise ValueError(f"rm_type={rm_type!r} is not a reward rule; choose one of {sorted(self._rules)}")
        if sample["label"] is None:
            raise ValueError(f"sample {sample['index']} has no label; rule {rm_type!r} compares against one")
        return float(rule(sample["response"], str(sample["label"])))

    def _resolve(self, result):
        if inspect.isawaitable(result):
            return self._loop.run_until_complete(result)
        return result


def die_with_parent(parent_pid: int) -> None:
    # A worker stuck in a job must not outlive a scorer that was SIGKILLed. The death
    # signal fires when the thread that started this process exits; the pool then sees
    # EOF and starts a new worker, so that case costs one worker restart, not a leak.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the death signal was armed


def main(read_fd: int, write_fd: int, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the scorer decides when workers stop
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    config: JobConfig = inbox.recv()
    sys.path[:] = list(config.sys_path)
    try:
        evaluate = JobEvaluator(config)
    except Exception as e:
        outbox.send(("startup_error", describe(e)))
        return
    outbox.send(("ready",))
    while True:
        try:
            job_id, payload = inbox.recv()
        except EOFError:
            return  # the scorer closed the pipe or died
        try:
            outbox.send((job_id, "ok", evaluate(payload)))
        except (Exception, SystemExit) as e:  # a user function calling sys.exit() is an error, not a shutdown
            outbox.send((job_id, "error", describe(e)))
