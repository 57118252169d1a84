"""GPU memory handoff between roles, through the supervisor's lease table.

A *tenant* is a role (or one engine) with the GPUs it occupies. `occupy` takes its leases
and asks it to bring memory back; `vacate` gives the leases up, reporting the bytes it
still holds, which the lease table checks against what it may keep (and, on fake GPUs,
against the exact ledger). The order of one PPO iteration is the loop's business; this
module makes each step safe and timed, and decides what a step means for each tenant.

Whether a tenant frees its memory when it gives up its GPUs is its `offloads` flag, as in
miles: trainers follow `--offload-train` (`sleep`/`wake_up` of the whole trainer),
engines `--offload-rollout` (release weights and KV cache after generating, take the
weights back for the sync and the KV cache after it). Colocated, both are on: the roles
take turns on the same GPUs. A tenant that does not offload still hands its lease over
between its phases, keeping everything resident (the lease table records it as a
residual): a second trainer on the same GPUs (the critic, which inherits the actor's)
can then work beside it, and the fake-GPU ledger charges both against one device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from runtime import ActorHandle, gather
from runtime.memory import LeaseTable


@dataclass(frozen=True)
class Tenant:
    name: str
    gpus: tuple[int, ...]
    free: Callable[[list[str]], object]   # returns a future of {"bytes_in_use", ...}
    take: Callable[[list[str]], object]
    report: Callable[[], object]          # a future of {"bytes_in_use", ...}; moves nothing
    offloads: bool                        # frees its memory when it gives up its GPUs


def engine_tenant(engine: ActorHandle, gpus: tuple[int, ...], *, offloads: bool) -> Tenant:
    return Tenant(engine.name, gpus, engine.release.call, engine.resume.call, engine.memory_report.call, offloads)


def trainer_tenant(trainer: ActorHandle, gpus: tuple[int, ...], *, offloads: bool) -> Tenant:
    return Tenant(trainer.name, gpus, trainer.offload.call, trainer.onload.call,
                  lambda: trainer.offload.call([]), offloads)


def per_gpu(tenant: Tenant, report: dict, tag: str | None = None) -> dict[int, int]:
    """{gpu: bytes the tenant holds there} (only those under `tag` when given) from its memory
    report: a rank group reports each rank's GPU ("by_gpu", roles.trainer.group), a
    one-process role one figure that holds on each of its GPUs."""
    by_gpu = report.get("by_gpu") or {g: report for g in tenant.gpus}
    return {g: by_gpu[g]["bytes_in_use"] if tag is None else by_gpu[g].get("ledger", {}).get(tag, 0)
            for g in tenant.gpus}


class Colocation:
    def __init__(self, leases: LeaseTable, holding: tuple[str, ...] = ()):
        """`holding`: tenants that hold their leases already (engines take theirs at spawn)."""
        self.leases = leases
        self.holding = set(holding)
        self.seconds = 0.0  # time spent handing memory over, for perf/offload_time

    def vacate(self, tenants: list[Tenant], tags: list[str], *, keep: str | None = None) -> None:
        """Give up the tenants' leases: an offloading tenant frees `tags` first (in parallel)
        and may leave only `keep` resident (the actor's weights, kept for the weight sync);
        any other keeps all it holds. What stays becomes a residual the next holder is told of.
        """
        tenants = [t for t in tenants if t.name in self.holding]
        if not tenants:
            return
        t0 = time.monotonic()
        reports = gather([t.free(tags) if t.offloads else t.report() for t in tenants])
        for t, rep in zip(tenants, reports):
            if t.offloads:
                may_keep = per_gpu(t, rep, keep) if keep else 0
            else:
                may_keep = per_gpu(t, rep)
            self.leases.release_all(list(t.gpus), t.name, per_gpu(t, rep), may_keep=may_keep)
            self.holding.discard(t.name)
        self.seconds += time.monotonic() - t0

    def occupy(self, tenants: list[Tenant], tags: list[str]) -> None:
        """Take the leases the tenants do not hold yet, then bring `tags` back onto their
        GPUs (a tag already resident costs nothing)."""
        t0 = time.monotonic()
        for t in tenants:
            if t.name not in self.holding:
                self.leases.acquire_all(list(t.gpus), t.name)
                self.holding.add(t.name)
        gather([t.take(tags) for t in tenants])
        self.seconds += time.monotonic() - t0

    @contextlib.contextmanager
    def sending_weights(self, sender: Tenant, receivers: list[Tenant]) -> Iterator[None]:
        """The weight sync: the sender allocates its bucket buffers, so it holds its GPUs.

        Receivers on the sender's GPUs (colocated engines, their weights already taken back)
        hand those leases over keeping their memory: loading a bucket copies into weights
        they hold and grows nothing. On exit the sender gives its leases up again keeping
        all it holds; `drop_residual` frees its weights after.
        """
        shared = [r for r in receivers if set(r.gpus) & set(sender.gpus)]
        t0 = time.monotonic()
        for r, rep in zip(shared, gather([r.report() for r in shared])):
            if r.name in self.holding:
                self.leases.release_all(list(r.gpus), r.name, per_gpu(r, rep), may_keep=per_gpu(r, rep))
                self.holding.discard(r.name)
        if sender.name not in self.holding:
            self.leases.acquire_all(list(sender.gpus), sender.name)
            self.holding.add(sender.name)
        self.seconds += time.monotonic() - t0
        yield
        t0 = time.monotonic()
        rep = sender.report().result()
        self.leases.release_all(list(sender.gpus), sender.name, per_gpu(sender, rep), may_keep=per_gpu(sender, rep))
        self.holding.discard(sender.name)
        self.seconds += time.monotonic() - t0

    def drop_residual(self, tenant: Tenant, tags: list[str]) -> None:
        """An offloading tenant without the lease frees what it kept (the actor's weights
        after the sync); a tenant that does not offload keeps them."""
        if not tenant.offloads or tenant.name in self.holding:
            return
        t0 = time.monotonic()
        rep = tenant.free(tags).result()
        for g in tenant.gpus:
            self.leases.report(g, tenant.name, per_gpu(tenant, rep)[g])
        self.seconds += time.monotonic() - t0

    def take_time(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
