"""GPU memory handoff between roles, through the supervisor's lease table.

A *tenant* is a role (or one engine) with the GPUs it occupies. `occupy` takes its leases
and asks it to bring memory back; `vacate` gives the leases up, reporting the bytes it
still holds, which the lease table checks against what it may keep (and, on fake GPUs,
against the exact ledger). The order of one PPO iteration is the loop's business; this
module makes each step safe and timed, and decides what a step means for each tenant.

What a tenant frees when it gives up its GPUs is its `frees` tags, as in miles: trainers
follow `--offload-train` (`sleep`/`wake_up` of the whole trainer), engines
`--offload-rollout` (release weights and KV cache after generating, take the weights back
for the sync and the KV cache after it); `--offload-{train,rollout}-level` narrows them
(a trainer that frees only its optimizer and grads, an engine only its KV cache). A tag
the tenant does not free stays resident when it hands its lease over: the lease table
records it as a residual, and the next holder works beside it (on one GPU: both
trainers' weights and the engine's beside whichever trainer trains); the fake-GPU ledger
charges them all against one device.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from roles.trainer.config import MEMORY_TAGS
from runtime import ActorHandle, gather
from runtime.memory import LeaseError, LeaseTable
from runtime.units import format_bytes


@dataclass(frozen=True)
class Tenant:
    name: str
    gpus: tuple[int, ...]
    free: Callable[[list[str]], object]   # returns a future of {"bytes_in_use", ...}
    take: Callable[[list[str]], object]
    report: Callable[[], object]          # a future of {"bytes_in_use", ...}; moves nothing
    frees: tuple[str, ...]                # tags it frees when it gives up its GPUs (none: keeps all)


def engine_tenant(engine: ActorHandle, gpus: tuple[int, ...], *, frees: tuple[str, ...]) -> Tenant:
    return Tenant(engine.name, gpus, engine.release.call, engine.resume.call, engine.memory_report.call, frees)


def trainer_tenant(trainer: ActorHandle, gpus: tuple[int, ...], *, frees: tuple[str, ...]) -> Tenant:
    return Tenant(trainer.name, gpus, trainer.offload.call, trainer.onload.call,
                  lambda: trainer.offload.call([]), frees)


def per_gpu(tenant: Tenant, report: dict, tags: tuple[str, ...] | None = None) -> dict[int, int]:
    """{gpu: bytes the tenant holds there} (only those under its ledger's `tags` when given)
    from its memory report: a rank group reports each rank's GPU ("by_gpu",
    roles.trainer.group), a one-process role one figure that holds on each of its GPUs."""
    by_gpu = report.get("by_gpu") or {g: report for g in tenant.gpus}
    return {g: by_gpu[g]["bytes_in_use"] if tags is None
            else sum(by_gpu[g].get("ledger", {}).get(tag, 0) for tag in tags) for g in tenant.gpus}


def allowed_residual(tenant: Tenant, report: dict, freed: list[str]) -> dict[int, int]:
    """{gpu: bytes the tenant may keep} after freeing `freed`.

    With a ledger (trainers): what it holds under every other tag, so a freed tag that left
    bytes behind is caught, plus up to UNTRACKED_LIMIT of device memory no tag covers (on a
    real GPU: buffers such as megatron's optimizer flags and rotary inverse frequencies, and
    what a trained step leaves beside a resident optimizer; never on fake GPUs, where the
    bytes in use are the ledger's sum). A freed tag's flat buffers (a real model's weights,
    grads) are far above the limit. Without one (engines): nothing when it freed all of its
    memory, and what it reports when it kept some (it cannot be checked tag by tag). A report
    may name the untracked allocations ("untracked"); a lease error quotes them.
    """
    reports = report.get("by_gpu") or {None: report}
    if not any("ledger" in r for r in reports.values()):
        keeps_some = not set(ENGINE_TAGS) <= set(freed)
        return per_gpu(tenant, report) if keeps_some else {g: 0 for g in tenant.gpus}
    tags = {tag for r in reports.values() for tag in r.get("ledger", {})}
    kept = per_gpu(tenant, report, tuple(sorted(tags - set(freed))))
    tagged, used = per_gpu(tenant, report, tuple(sorted(tags))), per_gpu(tenant, report)
    return {g: kept[g] + min(UNTRACKED_LIMIT, max(0, used[g] - tagged[g])) for g in tenant.gpus}


def untracked_note(report: dict) -> str:
    """What a memory report says of allocations outside its ledger's tags, for a lease error."""
    reports = report.get("by_gpu") or {None: report}
    return "".join(f"; {'' if g is None else f'gpu {g}: '}allocations no tag covers, largest first: "
                   + ", ".join(format_bytes(b) for b in r["untracked"])
                   for g, r in reports.items() if r.get("untracked"))


ENGINE_TAGS = ("weights", "kv_cache")  # what an engine holds (its graphs go with either)
UNTRACKED_LIMIT = 256 << 20  # a Qwen3-4B actor left 64-170 MiB beside its resident optimizer (docs/journal/)


class Colocation:
    def __init__(self, leases: LeaseTable, holding: tuple[str, ...] = ()):
        """`holding`: tenants that hold their leases already (engines take theirs at spawn)."""
        self.leases = leases
        self.holding = set(holding)
        self.seconds = 0.0  # time spent handing memory over, for perf/offload_time

    def build(self, tenant: Tenant, wait: Callable[[], None]) -> None:
        """A tenant that builds on its GPUs (a megatron trainer: DDP allocates its buffers there)
        holds their leases until `wait` returns (it is built), then gives them up having offloaded
        all it built: the next one builds on a GPU this one left empty (ppo.gpu.memory_plan's
        start-up phases)."""
        self.leases.acquire_all(list(tenant.gpus), tenant.name)
        self.holding.add(tenant.name)
        wait()
        rep = tenant.report().result()
        try:
            self.leases.release_all(list(tenant.gpus), tenant.name, per_gpu(tenant, rep),
                                    may_keep=allowed_residual(tenant, rep, list(MEMORY_TAGS)))
        except LeaseError as e:
            raise LeaseError(f"{e}{untracked_note(rep)}") from None
        self.holding.discard(tenant.name)

    def vacate(self, tenants: list[Tenant], tags: list[str], *, keep: str | None = None) -> None:
        """Give up the tenants' leases: each tenant frees those of `tags` it frees (in
        parallel), except `keep` (the actor's weights, kept for the weight sync), and may
        leave only what it did not free. What stays becomes a residual the next holder is
        told of."""
        tenants = [t for t in tenants if t.name in self.holding]
        if not tenants:
            return
        t0 = time.monotonic()
        freed = [[tag for tag in tags if tag in t.frees and tag != keep] for t in tenants]
        reports = gather([t.free(f) if f else t.report() for t, f in zip(tenants, freed)])
        for t, f, rep in zip(tenants, freed, reports):
            try:
                self.leases.release_all(list(t.gpus), t.name, per_gpu(t, rep), may_keep=allowed_residual(t, rep, f))
            except LeaseError as e:
                raise LeaseError(f"{e}{untracked_note(rep)}") from None
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

        Receivers that share the sender's leases (colocated engines, their weights already
        taken back) hand them over keeping their memory: loading a bucket copies into weights
        they hold and grows nothing. Side by side they hold a budget of their own and keep it.
        On exit the sender gives its leases up again keeping all it holds; `drop_residual`
        frees its weights after.
        """
        shared = [r for r in receivers if self.shares_lease(r, sender)]
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

    def shares_lease(self, a: Tenant, b: Tenant) -> bool:
        """Whether `a` and `b` take turns on a GPU (colocated) rather than hold it at once
        (GPUs of their own, or side by side in budgets of their own)."""
        return any(self.leases.same_lease(g, a.name, b.name) for g in set(a.gpus) & set(b.gpus))

    def drop_residual(self, tenant: Tenant, tags: list[str]) -> None:
        """A tenant without the lease frees those of `tags` it frees (the actor's weights
        after the sync); the others stay resident."""
        tags = [tag for tag in tags if tag in tenant.frees]
        if not tags or tenant.name in self.holding:
            return
        t0 = time.monotonic()
        rep = tenant.free(tags).result()
        for g in tenant.gpus:
            self.leases.report(g, tenant.name, per_gpu(tenant, rep)[g])
        self.seconds += time.monotonic() - t0

    def evict(self, tenant: Tenant) -> None:
        """A tenant whose processes died (a trainer group, before ppo.recovery starts it
        again): it holds no lease and keeps no memory from now on."""
        self.leases.forget(list(tenant.gpus), tenant.name)
        self.holding.discard(tenant.name)

    def take_time(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s
