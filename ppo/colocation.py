"""GPU memory handoff between colocated roles, through the supervisor's lease table.

A *tenant* is a role (or one engine) with the GPUs it occupies. `vacate` asks it to free
device memory (engines: release; trainers: offload), then releases its leases reporting
the bytes it still holds, which the lease table checks against what it may keep (and, on
fake GPUs, against the exact ledger). `occupy` takes the leases, then asks the tenant to
bring its memory back. The order of one PPO iteration is the loop's business; this module
only makes each step safe and timed.

When roles are not colocated each keeps its own GPUs and nothing here is needed: the
`Colocation` then does nothing, so the loop reads the same either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from runtime import ActorHandle, gather
from runtime.memory import LeaseTable


@dataclass(frozen=True)
class Tenant:
    name: str
    gpus: tuple[int, ...]
    free: Callable[[list[str]], object]   # returns a future of {"bytes_in_use", ...}
    take: Callable[[list[str]], object]


def engine_tenant(engine: ActorHandle, gpus: tuple[int, ...]) -> Tenant:
    return Tenant(engine.name, gpus, engine.release.call, engine.resume.call)


def trainer_tenant(trainer: ActorHandle, gpus: tuple[int, ...]) -> Tenant:
    return Tenant(trainer.name, gpus, trainer.offload.call, trainer.onload.call)


class Colocation:
    def __init__(self, leases: LeaseTable, enabled: bool):
        self.leases, self.enabled = leases, enabled
        self.seconds = 0.0  # time spent handing memory over, for perf/offload_time

    def vacate(self, tenants: list[Tenant], tags: list[str], *, keep: str | None = None) -> None:
        """Free `tags` on every tenant (in parallel), then release their leases.

        `keep` names one memory tag a tenant may leave resident (the actor's weights, kept for
        the weight sync): its bytes become a residual the next holder is told about.
        """
        if not self.enabled:
            return
        t0 = time.monotonic()
        reports = gather([t.free(tags) for t in tenants])
        for t, rep in zip(tenants, reports):
            may_keep = rep.get("ledger", {}).get(keep, 0) if keep else 0
            self.leases.release_all(list(t.gpus), t.name, {g: rep["bytes_in_use"] for g in t.gpus},
                                    may_keep=may_keep)
        self.seconds += time.monotonic() - t0

    def occupy(self, tenants: list[Tenant], tags: list[str]) -> None:
        """Take the tenants' leases, then bring `tags` back onto their GPUs."""
        if not self.enabled:
            return
        t0 = time.monotonic()
        for t in tenants:
            self.leases.acquire_all(list(t.gpus), t.name)
        gather([t.take(tags) for t in tenants])
        self.seconds += time.monotonic() - t0

    def drop_residual(self, tenant: Tenant, tags: list[str]) -> None:
        """A tenant without the lease frees what it kept (the actor after the weight sync)."""
        if not self.enabled:
            return
        t0 = time.monotonic()
        rep = tenant.free(tags).result()
        for g in tenant.gpus:
            self.leases.report(g, tenant.name, rep["bytes_in_use"])
        self.seconds += time.monotonic() - t0

    def take_time(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
