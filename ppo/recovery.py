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

from dataclasses import replace

from ppo import config as C
from ppo.config import PPOConfig
from ppo.observe.logger import RunLogger
from ppo.setup.job import Job
from ppo.state import checkpoint
from roles.trainer import TrainerGroup
from runtime import ActorDied


class TrainerDied(RuntimeError):
    """A trainer process died: the run stops (its state cannot be rebuilt without a checkpoint)."""


class TrainerRecovery:
    """The recovery policy of one run: whether a death is a trainer's, whether a recovery is
    left in the --max-trainer-restarts budget, and whether the newest checkpoint under --save is
    this run's (one ahead of the run was left there by another run)."""

    def __init__(self, job: Job, log: RunLogger, *, first_step: int):
        self.job, self.log, self.first_step = job, log, first_step
        self.done = 0

    def recover(self, died: ActorDied, start: checkpoint.ResumePoint) -> checkpoint.ResumePoint:
        """Where the run goes on after `died`; re-raises a death that is not a trainer's, and
        raises TrainerDied when the trainers cannot be brought back."""
        cfg, log = self.job.cfg, self.log
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
    point = checkpoint.restore(job, job.data, ckpt)
    log.rewind(ckpt.step)
    sup.publish("rewind", from_step=step, to_step=point.step, checkpoint=str(ckpt.actor_dir), role=died.role,
                reason=died.reason, trainer_restarts=trainer_restarts)
    return replace(point, counters=replace(point.counters, trainer_restarts=trainer_restarts,
                                           rewound_steps=rewound_steps + step - point.step))
