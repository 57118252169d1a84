"""Trainer recovery (--max-trainer-restarts N): a dead trainer rank brings the trainers back
from the newest checkpoint under --save, and the run goes on from the step after it.

The supervisor spawns, the driver decides (docs/reliability.md): the supervisor never
restarts a rank group by itself, because only the driver knows what its state must become.
Here the driver, within its budget of N recoveries:

1. stops and starts again every trainer group (all ranks new incarnations, a new rendezvous
   store: runtime.Supervisor.respawn_group), the live one too: both must go back to the
   checkpoint, and a fresh group loaded from it is exactly what `--load` resumes from;
2. forgets the leases and memory the old trainers held (ppo.gpu.colocation.Colocation.evict);
3. waits for the new trainers (the engines' memory released, as at the job's start);
4. reloads the trainers, data position and driver RNG from the checkpoint and syncs the
   engines, which take their GPUs, weights and KV cache back (ppo.state.checkpoint.restore, the
   machinery of --load, through ppo.gpu.handoffs' checkpoint window), drops the metrics
   of the steps after it (RunLogger.rewind), and publishes a `rewind` event for the trace.

A run resumed this way repeats an uninterrupted run's metrics, as a --load resume does; its
counters go back to the checkpoint's, but for `trainer_restarts`, which counts on.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from ppo import config as C
from ppo.config import PPOConfig
from ppo.observe.logger import RunLogger
from ppo.setup.job import Job
from ppo.gpu.weight_group import open_weight_broadcast
from ppo.state import checkpoint
from roles.trainer import TrainerGroup
from runtime import ActorDied
from runtime.agent import NodeLost
from runtime.cluster import ClusterSupervisor
from runtime.rendezvous import RendezvousFailed


class TrainerDied(RuntimeError):
    """A trainer process died: the run stops (its state cannot be rebuilt without a checkpoint)."""


class TrainerRecovery:
    """The recovery policy of one run: whether a death is a trainer's, whether a recovery is
    left in the --max-trainer-restarts budget, and whether the newest checkpoint under --save is
    this run's (one ahead of the run was left there by another run)."""

    def __init__(self, job: Job, log: RunLogger, *, first_step: int):
        self.job, self.log, self.first_step = job, log, first_step
        self.done = 0

    def recover(self, died: ActorDied | NodeLost, start: checkpoint.ResumePoint) -> checkpoint.ResumePoint:
        """Where the run goes on after `died`; re-raises a death that is not a trainer's, and
        raises TrainerDied when the trainers cannot be brought back. A node lost (a job across
        nodes) stops the run on every node, whichever role's death showed it."""
        cfg, log = self.job.cfg, self.log
        lost = self.job.sup.lost() if isinstance(self.job.sup, ClusterSupervisor) else {}
        if lost:
            return self.node_back(lost, died, start)
        if isinstance(died, NodeLost):
            raise died
        group = dead_trainer(self.job, died)
        if group is None:
            raise died
        ckpt = newest_checkpoint(self.job) if self.done < cfg.checkpoint.max_trainer_restarts else None
        if ckpt is None:
            raise trainer_died(cfg, group, died, self.done) from died
        if not self.first_step - 1 <= ckpt.step < log.step:
            raise trainer_died(cfg, group, died, self.done, why=f"the newest checkpoint under --save is of "
                               f"rollout {ckpt.step}, not of this run before rollout {log.step}") from died
        self.done += 1
        counters = start.counters  # as the loop left them
        try:
            return recover(self.job, log, died, ckpt, step=log.step, trainer_restarts=counters.trainer_restarts + 1,
                           rewound_steps=counters.rewound_steps)
        except (ActorDied, checkpoint.CheckpointError) as again:  # the recovery failed: stop
            raise trainer_died(cfg, group, died, self.done, why=f"recovery {self.done} failed: {again}") from again

    def node_back(self, lost: dict[int, NodeLost], died: ActorDied | NodeLost,
                  start: checkpoint.ResumePoint) -> checkpoint.ResumePoint:
        """A node lost: within --max-trainer-restarts and after a checkpoint of this run, wait (up to
        --rendezvous-timeout-s) for it to join again, start its roles anew and resume from the
        newest checkpoint; else stop the run on every node with one line."""
        cfg, log, job = self.job.cfg, self.log, self.job
        (rank, failure), *more = sorted(lost.items())
        ckpt = newest_checkpoint(job) if self.done < cfg.checkpoint.max_trainer_restarts and not more else None
        if ckpt is None or not self.first_step - 1 <= ckpt.step < log.step:
            raise node_lost(cfg, failure) from died
        if any(job.placement.node_of(g) == rank for g in job.placement.reward_model_gpus):
            raise node_lost(cfg, failure, why=f"node {rank} ran reward-model ranks, which are not started "
                            "again after a node loss yet") from died
        self.done += 1
        timeout = cfg.cluster.rendezvous_timeout_s
        print(f"tandem: {failure}; waiting up to {timeout:g} s for node {rank} to join again (start its launcher "
              f"with the same command), then resuming from its checkpoint of rollout {ckpt.step}",
              file=sys.stderr, flush=True)
        counters = start.counters
        try:
            bring_back(job, rank, timeout)
            return recover(job, log, died if isinstance(died, ActorDied) else ActorDied(f"node{rank}", 0, str(failure)),
                           ckpt, step=log.step, trainer_restarts=counters.trainer_restarts + 1,
                           rewound_steps=counters.rewound_steps)
        except (ActorDied, NodeLost, RendezvousFailed, checkpoint.CheckpointError) as again:
            raise node_lost(cfg, failure, why=f"recovery {self.done} failed: {again}") from again


def bring_back(job: Job, rank: int, timeout_s: float) -> None:
    """Lost node `rank` joins again (ClusterSupervisor.call_back); its engines start anew holding
    their GPUs' leases, as at the job's start (ppo.setup.job). Its trainer ranks come back with
    the trainers' recovery (`recover`)."""
    sup, colo, plan = job.sup, job.colocation, job.placement
    sup.call_back(rank, timeout_s)
    names = []
    for engine, gpus in zip(job.engines, plan.engines):
        if plan.node_of(gpus[0]) != rank:
            continue
        colo.holding.discard(engine.name)  # its leases went with the node's table
        for g in gpus:
            sup.leases.acquire(g, engine.name)
        colo.holding.add(engine.name)
        sup.respawn(engine.name)
        names.append(engine.name)
    sup.wait_ready(names)


def trainer_died(cfg: PPOConfig, group, e: ActorDied, recoveries: int, why: str | None = None) -> TrainerDied:
    """The one-line stop of a trainer death; `why` says why it was not recovered, when the
    count alone does not."""
    save = cfg.checkpoint.save
    resume = (f"resume from the last checkpoint with --load {save}" if save
              else "no checkpoint was being written (--save unset): the run must start over")
    limit = cfg.checkpoint.max_trainer_restarts
    recovered = (f" ({why})" if why else "" if not limit
                 else f" (after {recoveries} of --max-trainer-restarts {limit} recoveries)" if recoveries == limit
                 else " (before its first checkpoint: nothing to recover from)")
    return TrainerDied(f"the {group.name} trainer died: its rank {group.rank_of(e.role)} ({e.role}) died "
                       f"({e.reason}); the run stopped{recovered}. "
                       f"Error file: {e.error_file or 'none (killed without a traceback)'}; {resume}")


def node_lost(cfg: PPOConfig, lost: NodeLost, why: str | None = None) -> TrainerDied:
    """The one-line stop of a job across nodes that lost one (its trainer ranks there with it)."""
    save = cfg.checkpoint.save
    resume = (f"Start every node again with --load {save}" if save
              else "no checkpoint was being written (--save unset): the run must start over")
    return TrainerDied(f"{lost}; the run stopped on every node{f' ({why})' if why else ''}. {resume}")


def dead_trainer(job: Job, died: ActorDied) -> TrainerGroup | None:
    """The trainer group whose rank `died` names, or None (not a trainer)."""
    return next((g for g in (job.actor, job.critic) if g is not None and g.rank_of(died.role) is not None), None)


def newest_checkpoint(job: Job) -> checkpoint.Checkpoint | None:
    """The newest intact checkpoint this run wrote under --save, or None before its first."""
    cfg = job.cfg
    return checkpoint.locate(cfg.checkpoint.save, critic_load=C.critic_save(cfg), uses_critic=C.uses_critic(cfg),
                             hf_checkpoint=job.hf_checkpoint)


def recover(job: Job, log: RunLogger, died: ActorDied, ckpt: checkpoint.Checkpoint, *,
            step: int, trainer_restarts: int, rewound_steps: int) -> checkpoint.ResumePoint:
    """Bring the trainers back from `ckpt` after `died` (a trainer rank's death during rollout
    `step`); returns where the run goes on, its counters those of `ckpt` but for the counts of
    recoveries: `trainer_restarts` (this one included) and `rewound_steps` (before this one)
    plus the finished steps this one runs again."""
    colo, sup = job.colocation, job.sup
    reason = f"{died.role} died ({died.reason})"
    groups = [(g, t) for g, t in ((job.actor, job.actor_tenant), (job.critic, job.critic_tenant)) if g is not None]
    for group, tenant in groups:
        sup.respawn_group(group.name, reason)  # returns once the old ranks are gone
        colo.evict(tenant)
    # As at the job's start, the trainers build beside no engine memory (megatron builds on
    # the GPU); the restore then loads them and syncs the engines (ppo.state.checkpoint.restore).
    job.phases.leave("engines_release")
    sup.wait_ready([rank.name for group, _ in groups for rank in group.ranks])
    if job.weight_broadcast is not None:  # the new actor's rank 0 is in no weight group: all join a new one
        job.weight_broadcast = open_weight_broadcast(job)
    point = checkpoint.restore(job, job.data, ckpt)
    log.rewind(ckpt.step)
    sup.publish("rewind", from_step=step, to_step=point.step, checkpoint=str(ckpt.actor_dir), role=died.role,
                reason=died.reason, trainer_restarts=trainer_restarts)
    return replace(point, counters=replace(point.counters, trainer_restarts=trainer_restarts,
                                           rewound_steps=rewound_steps + step - point.step))
