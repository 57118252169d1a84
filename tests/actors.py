"""Actor classes for the runtime tests (a module, so spawned children can import them)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import warnings

import numpy as np

from runtime import Actor, endpoint


class Echo(Actor):
    def __init__(self, tag: str = "echo"):
        self.tag = tag
        self.log: list = []

    @endpoint
    def ping(self, x=None):
        return x

    @endpoint
    def record(self, i):
        self.log.append(i)
        return i

    @endpoint
    def history(self):
        return self.log

    @endpoint
    def sleep(self, seconds: float):
        time.sleep(seconds)
        return seconds

    @endpoint
    def fail(self, message: str):
        raise ValueError(message)

    @endpoint
    def env(self, *names):
        return {n: os.environ.get(n) for n in names}

    @endpoint
    def pid(self):
        return os.getpid()

    @endpoint
    def exit_now(self, code: int):
        os._exit(code)

    @endpoint
    def signal_self(self, sig: int):
        os.kill(os.getpid(), sig)
        time.sleep(30)

    @endpoint
    def bad_return(self):
        return object()

    @endpoint
    async def async_double(self, x):
        await asyncio.sleep(0.01)
        return 2 * x

    @endpoint
    def call_peer(self, peer, x):
        """Actor-to-actor: call another actor through a handle passed as an argument."""
        return peer.ping(x)

    @endpoint
    def spawn_grandchild(self):
        import subprocess
        return subprocess.Popen(["sleep", "60"]).pid

    def not_an_endpoint(self):
        return "secret"


class Counter(Actor):
    """Stateful: its count restarts from zero in a new incarnation."""

    def __init__(self):
        self.n = 0

    @endpoint
    def incr(self):
        self.n += 1
        return self.n


class FailsInInit(Actor):
    def __init__(self):
        raise RuntimeError("bad checkpoint path: /nonexistent")

    @endpoint
    def ping(self):
        return 1


class DiesOnCall(Actor):
    @endpoint
    def crash(self):
        os.kill(os.getpid(), signal.SIGKILL)


class SharedUser(Actor):
    """Writes into arrays it receives and hands out arrays from its own shared memory."""

    @endpoint
    def fill(self, x, value):
        x[...] = value
        return x.nbytes

    @endpoint
    def make_shared(self, n: int, value: float):
        from runtime import shared_empty

        a = shared_empty(n, "float32")
        a[:] = value
        self.kept = a  # the role keeps writing to it after the reply
        return a

    @endpoint
    def write_kept(self, value: float):
        self.kept[:] = value

    @endpoint
    def late_array(self, seconds: float, n: int):
        time.sleep(seconds)
        return np.ones(n, dtype=np.uint8)  # copied into this role's pool

    @endpoint
    def pool_is_free(self):
        from runtime import shm

        return all(s.free() for s in shm._process_pool._segments)


# What megatron-core says on import without apex, and a deprecation, as its own module would
# emit them: the code runs under megatron's module name and file.
MEGATRON_NOISE = """
import warnings
warnings.warn("Apex is not installed. Falling back to Torch Norm")
warnings.warn("the old layer spec is deprecated", DeprecationWarning, stacklevel=2)
"""


def megatron_noise() -> None:
    code = compile(MEGATRON_NOISE, "/site-packages/megatron/core/fusions/fused_layer_norm.py", "exec")
    exec(code, {"__name__": "megatron.core.fusions.fused_layer_norm"})


class Noisy(Actor):
    """Emits megatron-like noise and a warning of ours."""

    @endpoint
    def warn(self, ours: str):
        megatron_noise()
        warnings.warn(ours)
