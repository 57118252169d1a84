"""The GPU handoffs between the engines and the trainers that span several calls: the weight
sync, the engines taking back what they released, and the checkpoint window in which the
engines lend their GPUs to the trainers.

A trainer saves and loads with all its state on its GPUs: megatron reads and writes only
device state (its parameters are views into DDP's buffers, which offloading frees), and its
export gathers tensor-parallel shards and pipeline stages over the device's collectives.
So a checkpoint is written, and one is loaded, inside a window where the engines sharing the
trainers' GPUs have released them and each trainer in turn holds its lease with its weights
and optimizer on the device (colocated trainers share a lease, so they take turns). Engines
on GPUs of their own are not asked. The windows have no try/finally: an error inside one
either stops the run (SaveFailed) or is a trainer death, whose recovery evicts the trainers
and syncs the engines anew (ppo.recovery); one caught and survived would need it.

An engine found dead in a handoff is waited for and brought to the current policy version,
and the handoff runs again (`engine_handoff`).

This module sits below ppo.state.checkpoint (which saves and restores through these windows) and
ppo.loop; it knows the job only by the fields it reads.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from ppo import config as C
from runtime import ActorDied, gather


def engine_handoff(job, handoff, version: int) -> None:
    """Run a memory handoff of the engines (a phase of ppo.gpu.phases); an engine found
    dead in it (killed just before, or during its release/resume) is waited for and
    brought to `version` (0: no sync), and the handoff runs again: its steps are idempotent
    (releasing what is released or taking what is resident costs nothing, leases already
    taken are kept)."""
    while True:
        try:
            return handoff()
        except ActorDied as e:
            engine = next((x for x in job.engines if x.name == e.role), None)
            if engine is None:
                raise
            recover(job, engine, e.incarnation, version)


def recover(job, role, dead_incarnation: int, version: int) -> None:
    """Wait for a restarted engine or scorer; bring an engine to the current policy version."""
    job.sup.wait_restarted(role.name, dead_incarnation)
    if role.name.startswith("rollout-") and version > 0:
        index = job.engines.index(role)
        gpus = job.placement.engines[index]
        # Disaggregated or side by side, the actor's lease is free during a rollout: it takes it
        # to send (a resident actor allocates its bucket buffers there). Colocated it is offloaded.
        sending = (contextlib.nullcontext() if job.colocation.shares_lease(job.actor_tenant, job.engine_tenants[index])
                   else job.colocation.sending_weights(job.actor_tenant, []))
        if job.by_broadcast([role]) == [True]:  # its new incarnation is in no weight group: all join a new one
            from ppo.gpu.weight_group import open_weight_broadcast

            job.weight_broadcast = open_weight_broadcast(job)
        with sending:
            job.actor.sync_weights([role], job.cfg.engine.update_weight_buffer_size, version, engine_gpus=[gpus],
                                   by_broadcast=job.by_broadcast([role]))


def release_engines(job, version: int) -> None:
    """The engines hand their GPUs over, freeing their KV cache and weights (colocated)."""
    engine_handoff(job, lambda: job.phases.leave("engines_release"), version)


def sync_engines(job, version: int, perf=None) -> None:
    """The weight sync: engines take their weights back, the actor (holding its weights, not
    its lease) streams buckets, the actor frees its weights, engines take the KV cache back.
    A restarted engine needs no sync of its own while its weights come back: this one follows.
    `perf` (the step's phases) times it as phase weight_sync."""
    colo = job.colocation
    engine_handoff(job, lambda: job.phases.enter("engines_weights"), 0)
    with colo.sending_weights(job.actor_tenant, job.engine_tenants), \
            (perf.phase("weight_sync") if perf is not None else contextlib.nullcontext()):
        job.actor.sync_weights(job.engines, job.cfg.engine.update_weight_buffer_size, version,
                               engine_gpus=job.placement.engines, by_broadcast=job.by_broadcast(job.engines))
    if job.cfg.engine.check_weight_update_equal:
        check_weights_equal(job)
    colo.drop_residual(job.actor_tenant, ["params"])
    engine_handoff(job, lambda: job.phases.enter("engines_kv_cache"), version)


def engines_take_back(job, version: int, perf=None) -> None:
    """After a release with the policy unchanged: the engines take back everything they
    released. sglang threw its weights away at the release (no CPU backup: docs/architecture.md),
    so the actor pushes them again, same version; the torch engine restores its host copy."""
    if C.engines_discard_weights(job.cfg):
        job.phases.enter("actor_weights")  # the actor's weights back on its GPU,
        job.phases.leave("actor_weights")  # and resident beside the engines for the sync
        sync_engines(job, version, perf)
    else:
        engine_handoff(job, lambda: job.phases.enter("engines_resume"), version)


@contextlib.contextmanager
def lent_to_trainers(job, version: int, perf=None) -> Iterator[None]:
    """The engines lend their GPUs to the trainers for the body (a checkpoint's save, each
    trainer in `on_gpus`), then take back what they released. Engines on GPUs of their own,
    or side by side in a budget of their own, lend nothing and are not called (with
    --train-async they may be generating)."""
    shared = engines_share_trainer_gpus(job)
    if shared:
        release_engines(job, version)
    yield
    if shared:
        engines_take_back(job, version, perf)


def engines_share_trainer_gpus(job) -> bool:
    """Whether the engines take turns with the trainers on their GPUs (colocated; side by side
    each holds a budget of its own and lends nothing)."""
    return any(job.colocation.shares_lease(job.actor_tenant, e) for e in job.engine_tenants)


@contextlib.contextmanager
def on_gpus(job, tenant, *, keep: str | None = None) -> Iterator[None]:
    """One trainer holds its GPUs with its weights and optimizer on them for the body (a save
    or a load), then gives them up, keeping `keep` (the actor's weights, for a sync after a
    load). The engines must have released the GPUs (`release_engines`)."""
    with job.phases.during("trainer_state", [tenant], keep=keep):
        yield


class OnGPUs:
    """A trainer group whose checkpoint calls run inside `on_gpus`: what ppo.state.checkpoint's
    save_checkpoint calls to save."""

    def __init__(self, job, group, tenant):
        self.job, self.group, self.tenant = job, group, tenant

    def save(self, path: str) -> dict:
        with on_gpus(self.job, self.tenant):
            return self.group.save(path)

    def save_hf(self, path: str) -> dict:
        with on_gpus(self.job, self.tenant):
            return self.group.save_hf(path)


def check_weights_equal(job) -> None:
    """--check-weight-update-equal: every engine's weights equal the actor's, bit for bit."""
    want = job.actor.weights_checksum()
    for engine, got in zip(job.engines, gather([e.weights_checksum.call() for e in job.engines])):
        bad = sorted(k for k in want if got.get(k) != want[k]) + sorted(set(got) - set(want))
        if bad:
            raise RuntimeError(f"weight sync check failed: {engine.name} differs from the actor on "
                               f"{len(bad)} tensors, e.g. {bad[:5]}")
