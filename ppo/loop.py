"""The PPO driver: one function whose body is the steps of a PPO iteration.

Colocated, every GPU is held by one role at a time (docs/architecture.md):

    1. engines generate; reward scorers score as each engine finishes (with dynamic
       sampling, rounds of prompts until enough groups pass the filter: ppo.generate.dynamic_sampling)
    2. engines release weights and KV cache; a reward model scores on their GPUs, and the
       rewards are combined and post-processed (ppo.generate.rewards)
    3. actor: old log-probs (and reference log-probs only when a KL term is on); the driver
       compares them with the engine's (TIS weights, mismatch metrics)
    4. critic: values; the driver computes rewards (reward-level KL possible here), GAE
    5. critic trains, offloads
    6. actor trains unless in critic-only warm-up; keeps its weights for the sync
    7. engines take their weights back; the actor streams new weights bucket by bucket
       (sglang engines lose their weights at the release: they get them after every step)
    8. engines take the KV cache back
    9. every --eval-interval rollouts, the engines evaluate the new weights (ppo.generate.evaluation)
   10. every --save-interval rollouts, the engines lend the GPUs to the trainers, which save
       with their state on them (ppo.gpu.handoffs, ppo.state.checkpoint); next iteration

With --train-async (miles' train_async.py) the same steps run, but the rollout of step k + 1
is generated while steps 2-6 of step k train (ppo.generate.rollout_ahead): step 1 takes the rollout
made during the last step and starts the next; the engines keep their GPUs (step 2 moves
nothing; with --colocate they share them side by side, each role in its memory budget:
ppo.gpu.side_by_side); step 7 waits for the next rollout to finish before the weights change. The
samples are one version old, and decoupled PPO corrects for it (mismatch_correction).
"""

from __future__ import annotations

import statistics
import time

import torch

from algorithms import (compute_advantages, kl_estimate, masked_whiten, mismatch_metrics, reduce_metrics,
                        token_level_rewards)
from ppo import recovery
from ppo.recovery import TrainerDied  # what train() raises when a trainer dies past recovery
from ppo.state import checkpoint
from ppo.generate import evaluation, rewards
from ppo.gpu.handoffs import engines_take_back, recover, release_engines, sync_engines
from ppo import config as C
from ppo.generate.batch import build_batch, select
from ppo.config import PPOConfig
from ppo.config.serialize import to_dict
from ppo.generate.metrics import trajectory_metrics
from ppo.generate.sessions import session_ends
from ppo.generate.stops import stop_token_ids
from ppo.setup.job import Job, model_context, start_job
from ppo.observe.console import RunConsole
from ppo.generate.dynamic_sampling import sample_batch
from ppo.generate.partial import offpolicy_report, partial_rollout
from ppo.generate.engines import EngineClient
from ppo.generate.pump import Pump
from ppo.generate.partial_tools import partial_tool_rollout
from ppo.generate.setup import lockstep, rollout_function, generation_arguments
from ppo.observe.logger import RunLogger
from ppo.generate.rollout import SamplingParams
from ppo.generate.rollout_ahead import Rollouts
from ppo.gpu.side_by_side import SmPartition
from ppo.state.signals import SignalStops
from ppo.observe.trace import TraceWriter
from runtime import ActorDied
from runtime.agent import NodeLost


def train(cfg: PPOConfig, console: RunConsole | None = None, sm: SmPartition | None = None) -> list[dict]:
    """Run the job the config describes; returns the per-rollout metrics, or raises TrainerDied
    when a trainer dies past --max-trainer-restarts. `console` prints
    (default: as cfg.logging asks); RUN_DIR/trace.json follows the run's events. `sm`: the
    launcher's SM split of a side-by-side run (ppo.gpu.side_by_side.choose), logged as an event."""
    with SignalStops(cfg) as stops:  # Ctrl-C, SIGTERM, SIGUSR1: ppo.state.signals
        job = start_job(cfg, console, role_env=sm.role_env() if sm else None)
        if sm is not None:
            job.sup.publish("sm_partition", **sm.event())
        trace = TraceWriter(job.run_dir)
        try:
            return run(job, stops)
        finally:
            stops.closing()  # a signal now would cut the shutdown short
            job.close()
            trace.close()


def run(job: Job, stops: SignalStops | None = None) -> list[dict]:
    cfg = job.cfg
    # --load: trainers, data position, driver RNG and the engines' weights as the checkpoint left them
    start = (checkpoint.resume(job, job.data) if cfg.checkpoint.load is not None
             else checkpoint.ResumePoint(step=0, version=0))
    log = RunLogger(job.run_dir, num_rollout=cfg.rollout.num_rollout, publish=job.sup.publish,
                    use_tensorboard=cfg.logging.use_tensorboard, use_wandb=cfg.logging.use_wandb,
                    wandb_project=cfg.logging.wandb_project, dump_samples=cfg.logging.dump_samples,
                    config=to_dict(cfg), start_step=start.step, resumed=cfg.checkpoint.load is not None,
                    console=job.console)
    recoveries = recovery.TrainerRecovery(job, log, first_step=start.step)
    try:
        while True:
            try:
                with rollout_source(job) as rollouts:  # a recovery starts with no rollout ahead
                    steps(job, log, start, stops, rollouts)
                break
            except (ActorDied, NodeLost) as e:  # a trainer's or a node's: back to the newest checkpoint, or stop
                start = recoveries.recover(e, start)  # (ppo.recovery)
    finally:
        log.close()
    return log.history


def steps(job: Job, log: RunLogger, start: checkpoint.ResumePoint, stops: SignalStops | None,
          rollouts: Rollouts) -> None:
    """The PPO iterations from `start` to --num-rollout; `start.counters` counts on."""
    cfg, phases = job.cfg, job.phases  # every GPU memory move is a phase of the plan (ppo.gpu.phases)
    actor, critic = job.actor, job.critic
    tis_function, post_process = job.functions.tis_function, job.functions.post_process
    version, counters = start.version, start.counters  # counters over the run, a resumed run's earlier part included
    for step in range(start.step, cfg.rollout.num_rollout):
        if stops is not None:
            stops.step = step
        perf = log.step_phases(step)  # perf/*_time; each phase is a span in RUN_DIR/trace.json
        book = StepBook(job, counters, perf)
        if evaluation.due_before_training(cfg, step):  # the initial weights
            run_eval(job, log, perf, step, version)

        # 1. generate and score (a role that dies here is replaced and its work re-issued),
        # in rounds while dynamic sampling's filter drops groups; ahead: made during the last
        # step, and the next starts now
        with perf.phase("rollout"):
            samples, sampling_metrics = rollouts.take(step, version)

        # 2. engines release the GPUs (ahead, they keep them generating); a reward model scores,
        # and the rewards are final (weighted, post-processed: ppo.generate.rewards)
        if not rollouts.ahead:
            release_engines(job, version)
        book.add(sampling_metrics, rewards.finish(job, samples, perf, post_process))
        batch = build_batch(samples, pad_id=job.tok.pad_token_id)

        # 3. the actor takes the GPUs: old and reference log-probs
        with phases.during("log_probs"), perf.phase("log_probs"):
            batch["old_log_probs"] = actor.compute_log_probs(select(batch))["log_probs"]
            if C.needs_ref(cfg):
                batch["ref_log_probs"] = actor.compute_ref_log_probs(select(batch))["log_probs"]
        book.add(mismatch_correction(cfg, batch, tis_function))  # may add batch["tis_weights"]
        book.add(offpolicy_report(batch, version))  # a partial rollout's carried tokens (ppo.generate.partial)

        # 4. critic values, then advantages in the driver
        if critic is not None:
            with phases.during("values"), perf.phase("values"):
                batch["values"] = critic.compute_values(select(batch))["values"]
        with perf.phase("advantages"):
            batch["advantages"], batch["returns"] = advantages(cfg, batch)

        # 5. critic update
        if critic is not None:
            with phases.during("critic_train"), perf.phase("critic_train"):
                book.trained("critic-", critic.train(dict(select(batch, "returns"), old_values=batch["values"])))

        # 6. actor update, unless the critic is still warming up
        if step >= C.num_critic_only_steps(cfg):
            with phases.during("actor_train"), perf.phase("actor_train", metric="perf/train_time"):
                book.trained("", actor.train(actor_batch(cfg, batch)))  # its weights stay for the sync

            version += 1
            rollouts.wait_generated(version)  # ahead: weights change between rollouts only
            sync_engines(job, version, perf)  # 7. weight sync
        elif not rollouts.ahead:  # 7'. weights unchanged: engines take back what they released
            engines_take_back(job, version, perf)  # (sglang's from the actor; ahead, they released nothing)

        # 8. eval on the engines, which hold the new weights and their KV cache again
        if evaluation.due_after(cfg, step):
            run_eval(job, log, perf, step + 1, version)

        log.dump_samples(step, samples)
        log.log(step, book.close(version, rollout_metrics(batch, samples)))
        # 9. checkpoint: the trainers save with their state on the GPUs the engines lend them
        saved = checkpoint.save_if_due(job, step, data=rollouts.data_position(), version=version, counters=counters,
                                       force=stops is not None and stops.save_requested)
        if stops is not None:  # SIGUSR1 (or SIGTERM with --save-on-signal): saved, now stop
            stops.after_step(step, saved=saved, last=step == cfg.rollout.num_rollout - 1)


class StepBook:
    """One step's metrics and the run's counters that it moves: role restarts during the step,
    optimizer steps skipped for a non-finite loss or gradient (past --max-skipped-updates the run
    stops), prompt lines left out, the step's time."""

    def __init__(self, job: Job, counters, perf):
        self.job, self.counters, self.perf = job, counters, perf
        self.started, self.restarts_before = time.monotonic(), job.sup.restart_counts()
        self.metrics: dict[str, float] = {}

    def add(self, *metrics: dict) -> None:
        for m in metrics:
            self.metrics.update(m)

    def trained(self, prefix: str, metrics: dict) -> None:
        """A trainer's update: its metrics as train/{prefix}NAME, its skipped steps counted."""
        self.counters.skipped_updates = check_skipped(self.job.cfg, self.counters.skipped_updates
                                                      + metrics["skipped_nonfinite"])
        self.add({f"train/{prefix}{k}": v for k, v in metrics.items()})

    def close(self, version: int, rollout: dict) -> dict:
        """The step's record for the log, with the counters' totals."""
        c, perf = self.counters, self.perf
        engine_restarts, scorer_restarts = restarts_since(self.job, self.restarts_before)
        c.engine_restarts += engine_restarts
        c.scorer_restarts += scorer_restarts
        c.skipped_samples = self.job.data.num_skipped  # lines of --prompt-data left out
        perf["perf/offload_time"] = self.job.colocation.take_time()
        perf["perf/step_time"] = time.monotonic() - self.started
        return {**rollout, **self.metrics,
                "rollout/engine_restarts": engine_restarts,
                "rollout/skipped_samples": c.skipped_samples,
                "rollout/scorer_restarts": scorer_restarts,
                "train/skipped_updates_total": c.skipped_updates,
                "rollout/engine_restarts_total": c.engine_restarts,
                "rollout/scorer_restarts_total": c.scorer_restarts,
                "train/trainer_restarts_total": c.trainer_restarts,  # ppo.recovery
                "train/rewound_steps_total": c.rewound_steps,
                "rollout/weight_version": version, **perf}


def rollout_source(job: Job) -> Rollouts:
    """Step 1 of the loop: each step's samples, generated then or one step ahead (--train-async).
    An engine or scorer that dies is replaced; an engine is brought to the actor's version."""
    cfg, tok = job.cfg, job.tok
    sampling = sampling_params(cfg, stop_token_ids(cfg, tok))
    rollout = job_rollout_function(job)

    def generate(prompts: list[dict], step: int, sampling_round: int) -> list[dict]:
        return rollout(job.engines, job.scorers, prompts, sampling, step, decode=tok.decode,
                       eos_id=tok.eos_token_id, recover=recover_engine, sampling_round=sampling_round)

    def recover_engine(role, dead: int) -> None:
        with rollouts.lock:  # ahead, the driver's thread may be training meanwhile (ppo.generate.rollout_ahead)
            recover(job, role, dead, rollouts.version)

    def engine_client(pump: Pump) -> EngineClient:
        return EngineClient(job.engines, pump, recover_engine, lockstep=lockstep(cfg))

    def rollout_of(step: int):
        if cfg.rollout.partial_rollout and job.functions.generation is not None:  # tool trajectories
            return partial_tool_rollout(engine_client, job.scorers, job.data, sampling, step,
                                        num_groups=cfg.rollout.rollout_batch_size,
                                        over_sampling=C.over_sampling_batch_size(cfg),
                                        mask_offpolicy=cfg.rollout.mask_offpolicy_in_partial_rollout,
                                        decode=tok.decode, eos_id=tok.eos_token_id, recover=recover_engine,
                                        **generation_arguments(job.functions.generation, cfg, tok,
                                                               model_context(job.hf_checkpoint)))
        if cfg.rollout.partial_rollout:  # job.data is a PartialSource (ppo.setup.job)
            return partial_rollout(job.engines, job.scorers, job.data, sampling, step,
                                   num_groups=cfg.rollout.rollout_batch_size,
                                   over_sampling=C.over_sampling_batch_size(cfg),
                                   mask_offpolicy=cfg.rollout.mask_offpolicy_in_partial_rollout,
                                   decode=tok.decode, eos_id=tok.eos_token_id, recover=recover_engine,
                                   lockstep=cfg.engine.rollout_backend == "torch",
                                   dynamic_sampling=job.functions.dynamic_sampling)
        return sample_batch(lambda prompts, rnd: generate(prompts, step, rnd), job.data.next_batch,
                            job.functions.dynamic_sampling)

    rollouts = Rollouts(rollout_of, generate, data=job.data, ahead=cfg.rollout.train_async, num_rollout=cfg.rollout.num_rollout,
                        max_staleness=cfg.rollout.max_weight_staleness)
    return rollouts


def job_rollout_function(job: Job):
    """One response per prompt (ppo.generate.rollout), or the configured generate function's trajectories."""
    return rollout_function(job.functions.generation, job.cfg, job.tok, model_context(job.hf_checkpoint))


def run_eval(job: Job, log: RunLogger, perf, tag: int, version: int) -> None:
    """Evaluate the engines' weights (policy `version`) on the eval sets, timed as phase `eval`
    (perf/eval_time of the step); logged and dumped under step `tag` (ppo.generate.evaluation)."""
    with perf.phase("eval"):
        metrics, samples = evaluation.evaluate(
            job.engines, job.scorers, job.eval_sets, tag, decode=job.tok.decode, eos_id=job.tok.eos_token_id,
            recover=lambda role, dead: recover(job, role, dead, version), rollout=job_rollout_function(job))
    log.log_eval(tag, {**metrics, "eval/weight_version": version}, samples)


def restarts_since(job: Job, before: dict[str, int]) -> tuple[int, int]:
    """(engine, scorer) restarts since `before` (a `sup.restart_counts()`); scorers are the rule
    scorers and the reward model's ranks. The supervisor counts each at the death, so one the
    loop never saw (a scorer killed idle and back before its next call) counts, and one seen by
    two calls counts once."""
    now = job.sup.restart_counts()
    def since(roles):
        return sum(now.get(r.name, 0) - before.get(r.name, 0) for r in roles)
    return since(job.engines), since([*job.scorers, *job.reward_models])


def check_skipped(cfg: PPOConfig, skipped: float) -> float:
    """The run's count of skipped optimizer steps, or an error once it passes the limit."""
    limit = cfg.training.max_skipped_updates
    if skipped > limit:
        raise RuntimeError(
            f"{int(skipped)} optimizer steps were skipped for a non-finite loss or gradient "
            f"(--max-skipped-updates {limit}); the run stops rather than train on garbage. "
            "Check the rewards and advantages in RUN_DIR/samples, or lower --lr")
    return skipped


def sampling_params(cfg: PPOConfig, stop_ids: tuple[int, ...]) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(n_samples_per_prompt=r.n_samples_per_prompt, max_new_tokens=r.rollout_max_response_len,
                          temperature=r.rollout_temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                          stop_token_ids=stop_ids, seed=r.rollout_seed)


def advantages(cfg: PPOConfig, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards (outcome score on the last token, minus the reward-level KL), then the
    configured estimator, then optional whitening over the batch."""
    p, mask = cfg.ppo, batch["loss_mask"]
    kl = kl_estimate(batch["old_log_probs"], batch["ref_log_probs"], "k1") if p.kl_coef else None
    rewards = token_level_rewards(batch["scores"], mask, kl=kl, kl_coef=p.kl_coef)
    adv, returns = compute_advantages(p.advantage_estimator, mask=mask, token_rewards=rewards,
                                      values=batch.get("values"), group_size=cfg.rollout.n_samples_per_prompt,
                                      sessions=batch.get("sessions"), gamma=p.gamma, lam=p.lambd)
    if p.normalize_advantages:
        adv = masked_whiten(adv, mask)
    return adv, returns


def mismatch_correction(cfg: PPOConfig, batch: dict, tis_function) -> dict[str, float]:
    """Trainer (old_log_probs) against engine (rollout_log_probs) log-probs of the same tokens:
    with --use-tis, batch["tis_weights"] [N, R] from `tis_function` (algorithms.mismatch
    states its contract) and their metrics. With --train-async too: decoupled PPO (AReaL), whose
    proximal policy is the trainer's before the update and behaviour policy the engine's one
    version back; the actor's ratio is taken against the proximal one, and the weights carry
    the rest of the way to the behaviour policy (docs/algorithms.md); with --get-mismatch-metrics, train/mis_* (miles'
    names). Computed once here: both log-probs are fixed for the whole rollout."""
    p, mask, out = cfg.ppo, batch["loss_mask"], {}
    train, engine = batch["old_log_probs"], batch["rollout_log_probs"]
    if C.use_tis(cfg):
        weights, metrics = tis_function(train_log_probs=train, rollout_log_probs=engine, mask=mask,
                                        tis_clip=p.tis_clip, tis_clip_low=p.tis_clip_low)
        if not isinstance(weights, torch.Tensor) or weights.shape != mask.shape:
            raise ValueError(f"the TIS function {p.custom_tis_function_path or 'truncated_is'} returned weights of "
                             f"shape {getattr(weights, 'shape', type(weights))}, expected {tuple(mask.shape)}")
        batch["tis_weights"] = torch.where(mask != 0, weights.detach().float(), 0.0)
        out.update({f"train/{k}": v for k, v in reduce_metrics(metrics, mask).items()})
    if p.get_mismatch_metrics:
        out.update({f"train/mis_{k}": v for k, v in reduce_metrics(mismatch_metrics(train, engine, mask), mask).items()})
    return out


def actor_batch(cfg: PPOConfig, batch: dict) -> dict:
    """What the actor trains on; with --use-rollout-logprobs the ratio's old log-probs are the engine's."""
    keys = ("advantages",) + tuple(k for k in ("ref_log_probs", "tis_weights") if k in batch)
    out = select(batch, *keys)
    out["old_log_probs"] = batch["rollout_log_probs" if cfg.ppo.use_rollout_logprobs else "old_log_probs"]
    return out


def rollout_metrics(batch: dict, samples: list[dict]) -> dict[str, float]:
    mask = batch["loss_mask"]
    n_tok = mask.sum().clamp(min=1)
    return {
        # per sampled response: an agent session's records share its reward and count once (ppo.generate.sessions)
        "rollout/raw_reward": statistics.fmean(float(s["reward"]) for s in session_ends(samples)),
        "rollout/response_len": batch["response_lens"].float().mean().item(),
        "rollout/truncated": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
        "rollout/reward_failures": sum(s["reward_status"] != "ok" for s in samples),
        # aborts its engine answered by issuing the request again (roles/rollout/aborts.py)
        "rollout/aborted_requests": sum(s["num_aborts"] for s in samples),
        # engine vs trainer log-probs of the same tokens: ~0 when the weight sync is right
        "rollout/log_probs_diff": ((batch["old_log_probs"] - batch["rollout_log_probs"]).abs() * mask).sum().item()
                                  / n_tok.item(),
        "rollout/advantages": (batch["advantages"] * mask).sum().item() / n_tok.item(),
        "rollout/returns": (batch["returns"] * mask).sum().item() / n_tok.item(),
        **trajectory_metrics(samples),
    }
