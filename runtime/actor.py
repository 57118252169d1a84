"""Actors: the base class, ``@endpoint``, and the lifecycle state machine.

An Actor subclass is a plain Python object: constructed directly it works in-process
with no runtime (that is how role unit tests use it). Spawned by a Supervisor, it runs
in its own process (see ``runtime.child``) and its endpoints are called over ZeroMQ.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

ENDPOINT_ATTR = "__tandem_endpoint__"


def endpoint(fn: Callable) -> Callable:
    """Mark a method as callable from other processes (sync or ``async def``)."""
    setattr(fn, ENDPOINT_ATTR, True)
    return fn


def endpoints_of(cls: type) -> frozenset[str]:
    return frozenset(name for name, fn in inspect.getmembers(cls, callable)
                     if getattr(fn, ENDPOINT_ATTR, False))


@dataclass(frozen=True)
class ActorContext:
    """What a spawned actor knows about itself; ``None`` for an in-process object."""

    name: str
    incarnation: int
    run_dir: str
    gpus: tuple[int, ...]
    publish: Callable[..., None]  # publish(event, **fields) onto the run's event bus
    group: str | None = None  # its group: for a rank of a rank group, the role's name ("actor")


class IllegalTransition(RuntimeError):
    pass


class Actor:
    """Base class of every role.

    ``lifecycle`` maps each state to the states it may move to. The runtime moves an
    actor from ``starting`` to ``ready``; roles extend the table with their own states
    (``offloaded``, ``training``, ...) and move with ``set_state``, which validates the
    move and publishes it as a ``state`` event. ``dead`` is decided by the supervisor.
    """

    lifecycle: ClassVar[dict[str, frozenset[str]]] = {"starting": frozenset({"ready"}),
                                                      "ready": frozenset()}

    _tandem_ctx: ActorContext | None = None
    _tandem_state: str = "ready"  # an in-process object is ready once built; a spawned one starts "starting"

    @property
    def context(self) -> ActorContext | None:
        return self._tandem_ctx

    @property
    def state(self) -> str:
        return self._tandem_state

    def set_state(self, new: str, **fields: Any) -> None:
        old = self._tandem_state
        if new == old:
            return
        if new not in self.lifecycle.get(old, ()):
            raise IllegalTransition(
                f"{type(self).__name__}: {old} -> {new} is not a legal transition "
                f"(from {old}: {sorted(self.lifecycle.get(old, ())) or 'none'})")
        self._tandem_state = new
        ctx = self._tandem_ctx
        if ctx is not None:
            ctx.publish("state", role=ctx.name, incarnation=ctx.incarnation, gpus=list(ctx.gpus),
                        old=old, new=new, **fields)

    def on_stop(self) -> None:
        """Called once as the spawned role's process ends (SIGTERM from the supervisor's stop or
        shutdown, or a failure), to release what would outlive it (an inference server's
        processes). The runtime gives it ChildBoot.stop_timeout_s, then kills whatever the role
        left in its session (runtime.child). Not an endpoint; in-process, nobody calls it."""

    def publish_span(self, phase: str, t0: float, **fields: Any) -> None:
        """Publish finished work as a `phase` span on this role's track (runtime.events):
        `t0` is its start by time.time(). In-process (no context) it does nothing."""
        ctx = self._tandem_ctx
        if ctx is not None:
            ctx.publish("phase", phase=phase, action="span", t0=t0, seconds=round(time.time() - t0, 6),
                        gpus=list(ctx.gpus), **fields)
