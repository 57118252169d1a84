"""Values derived from a `PPOConfig`: pure functions, so the config itself is never rewritten.

Every fallback ("unset means the actor's value", "colocation turns offloading on") is
resolved here and only here; roles and the loop call these instead of re-deriving.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ppo.config.schema import PPOConfig


def uses_critic(cfg: PPOConfig) -> bool:
    """A critic exists exactly when advantages come from GAE (`--advantage-estimator ppo`)."""
    return cfg.ppo.advantage_estimator == "ppo"


def needs_ref(cfg: PPOConfig) -> bool:
    """Whether reference log-probs are computed at all; with every KL term off none is scheduled."""
    kl_loss_on = cfg.ppo.use_kl_loss and cfg.ppo.kl_loss_coef != 0
    return kl_loss_on or cfg.ppo.kl_coef != 0


def num_critic_only_steps(cfg: PPOConfig) -> int:
    """Critic warm-up rollouts: the flag when set; unset, 1 with a critic (the miles PPO
    example's value) and 0 without one, so `--advantage-estimator grpo` alone runs."""
    steps = cfg.ppo.num_critic_only_steps
    if steps is not None:
        return steps
    return 1 if uses_critic(cfg) else 0


def over_sampling_batch_size(cfg: PPOConfig) -> int | None:
    """Prompts per dynamic-sampling round (miles: --rollout-batch-size when unset)."""
    r = cfg.rollout
    return r.rollout_batch_size if r.over_sampling_batch_size is None else r.over_sampling_batch_size


def ratio_level(cfg: PPOConfig) -> str:
    """The policy ratio the actor's loss takes: GSPO's per sequence, otherwise per token."""
    return "sequence" if cfg.ppo.advantage_estimator == "gspo" else "token"


def eps_clip_high(cfg: PPOConfig) -> float:
    return cfg.ppo.eps_clip if cfg.ppo.eps_clip_high is None else cfg.ppo.eps_clip_high


@dataclass(frozen=True, kw_only=True)
class OptimizerSettings:
    """One trainer's resolved optimizer and LR schedule."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    clip_grad: float


def actor_optimizer(cfg: PPOConfig) -> OptimizerSettings:
    o = cfg.optimizer
    return OptimizerSettings(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, lr_decay_style=o.lr_decay_style,
        lr_warmup_iters=o.lr_warmup_iters, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, clip_grad=o.clip_grad,
    )


def critic_optimizer(cfg: PPOConfig) -> OptimizerSettings:
    """The actor's settings, with each `--critic-*` value that is set taking its place."""
    o = cfg.optimizer
    actor = actor_optimizer(cfg)
    return replace(
        actor,
        lr=actor.lr if o.critic_lr is None else o.critic_lr,
        weight_decay=actor.weight_decay if o.critic_weight_decay is None else o.critic_weight_decay,
        lr_warmup_iters=(actor.lr_warmup_iters if o.critic_lr_warmup_iters is None
                         else o.critic_lr_warmup_iters),
    )


def critic_load(cfg: PPOConfig) -> str | None:
    """The critic's sibling of --load, as critic_save is of --save. Never --load itself: in
    miles the critic falls back to --load and so loads the actor's checkpoint."""
    c = cfg.checkpoint
    if c.critic_load is not None or c.load is None:
        return c.critic_load
    return c.load.rstrip("/") + "_critic"


def critic_save(cfg: PPOConfig) -> str | None:
    """A sibling of --save, so actor and critic keep separate checkpoint trackers."""
    c = cfg.checkpoint
    if c.critic_save is not None or c.save is None:
        return c.critic_save
    return c.save.rstrip("/") + "_critic"


def offload_train(cfg: PPOConfig) -> bool:
    """Trainers leave the GPUs to others: needed when colocated, and by default with a critic,
    because actor and critic share the same GPUs."""
    p = cfg.placement
    if p.offload_train is not None:
        return p.offload_train
    return p.colocate or uses_critic(cfg)


def offload_rollout(cfg: PPOConfig) -> bool:
    """Engines release their memory for the trainers: by default when colocated, but not side
    by side, where they keep it and generate while the trainers train."""
    p = cfg.placement
    return p.colocate and not side_by_side(cfg) if p.offload_rollout is None else p.offload_rollout


def side_by_side(cfg: PPOConfig) -> bool:
    """--train-async --colocate: engines and trainers resident on the same GPUs at once, each in
    its memory budget (the engine's --sglang-mem-fraction-static of the GPU, the trainers' the
    rest), the SMs shared under MPS (docs/architecture.md, "Side by side on one GPU")."""
    return cfg.rollout.train_async and cfg.placement.colocate


def train_offload_tags(cfg: PPOConfig) -> tuple[str, ...]:
    """The trainer memory tags an offloading trainer frees when it hands its GPUs over; none
    when trainers do not offload."""
    if not offload_train(cfg):
        return ()
    return {"all": ("params", "grads", "optimizer"), "optimizer": ("grads", "optimizer")}[
        cfg.placement.offload_train_level]


def rollout_offload_tags(cfg: PPOConfig) -> tuple[str, ...]:
    """The engine memory tags an offloading engine releases after generating; none when
    engines do not offload."""
    if not offload_rollout(cfg):
        return ()
    return {"all": ("weights", "kv_cache"), "kv_cache": ("kv_cache",)}[cfg.placement.offload_rollout_level]


def engines_discard_weights(cfg: PPOConfig) -> bool:
    """Whether the engines' weights come back from a release as garbage, so that the driver
    must push the actor's weights after every resume: sglang releases them through
    torch_memory_saver without a CPU backup (docs/architecture.md, "sglang weights across a
    release", says why we push rather than back up). The torch engine keeps a host copy."""
    return cfg.engine.rollout_backend == "sglang" and "weights" in rollout_offload_tags(cfg)


def use_tis(cfg: PPOConfig) -> bool:
    """Whether the policy loss carries TIS weights: --use-tis, or --train-async, whose decoupled
    PPO weights each token by the trainer's probability before the update over the engine's
    (docs/algorithms.md), unless --use-rollout-logprobs takes the ratio against the engine's; or
    --partial-rollout without --mask-offpolicy-in-partial-rollout, whose tokens carried from earlier
    rollouts were sampled by older weights (their engine log-probs are those weights')."""
    p, r = cfg.ppo, cfg.rollout
    off_policy = r.train_async or (r.partial_rollout and not r.mask_offpolicy_in_partial_rollout)
    return p.use_tis or (off_policy and not p.use_rollout_logprobs)


def actor_gpus_per_node(cfg: PPOConfig) -> int:
    """--actor-num-gpus-per-node, or every GPU of the node when unset (so --num-gpus-per-node
    8 gives a recipe written for 4 GPUs two data-parallel ranks)."""
    p = cfg.placement
    return p.num_gpus_per_node if p.actor_num_gpus_per_node is None else p.actor_num_gpus_per_node


def actor_num_gpus(cfg: PPOConfig) -> int:
    return cfg.placement.actor_num_nodes * actor_gpus_per_node(cfg)


def rollout_num_gpus(cfg: PPOConfig) -> int | None:
    """Colocated engines use exactly the actor's GPUs; otherwise --rollout-num-gpus (required)."""
    return actor_num_gpus(cfg) if cfg.placement.colocate else cfg.placement.rollout_num_gpus


def num_engines(cfg: PPOConfig) -> int:
    return (rollout_num_gpus(cfg) or 0) // cfg.engine.rollout_num_gpus_per_engine


def model_parallel_size(cfg: PPOConfig) -> int:
    p = cfg.parallelism
    return p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size


def data_parallel_size(cfg: PPOConfig) -> int:
    return actor_num_gpus(cfg) // model_parallel_size(cfg)


def samples_per_rollout(cfg: PPOConfig) -> int:
    return (cfg.rollout.rollout_batch_size or 0) * cfg.rollout.n_samples_per_prompt


def global_batch_size(cfg: PPOConfig) -> int:
    """--global-batch-size, else the rollout split into --num-steps-per-rollout steps, else one
    step per rollout."""
    if cfg.training.global_batch_size is not None:
        return cfg.training.global_batch_size
    return samples_per_rollout(cfg) // (cfg.ppo.num_steps_per_rollout or 1)


def derived_values(cfg: PPOConfig) -> dict:
    """Every derived value by name, for the dry run and the run's config.json neighbour."""
    return {
        "uses_critic": uses_critic(cfg),
        "needs_ref": needs_ref(cfg),
        "eps_clip_high": eps_clip_high(cfg),
        "num_critic_only_steps": num_critic_only_steps(cfg),
        "over_sampling_batch_size": over_sampling_batch_size(cfg),
        "ratio_level": ratio_level(cfg),
        "offload_train": offload_train(cfg),
        "offload_rollout": offload_rollout(cfg),
        "side_by_side": side_by_side(cfg),
        "train_offload_tags": list(train_offload_tags(cfg)),
        "rollout_offload_tags": list(rollout_offload_tags(cfg)),
        "engines_discard_weights": engines_discard_weights(cfg),
        "use_tis": use_tis(cfg),
        "actor_num_gpus": actor_num_gpus(cfg),
        "rollout_num_gpus": rollout_num_gpus(cfg),
        "num_engines": num_engines(cfg),
        "data_parallel_size": data_parallel_size(cfg),
        "samples_per_rollout": samples_per_rollout(cfg),
        "global_batch_size": global_batch_size(cfg),
        "critic_load": critic_load(cfg),
        "critic_save": critic_save(cfg),
        "actor_optimizer": asdict(actor_optimizer(cfg)),
        "critic_optimizer": asdict(critic_optimizer(cfg)) if uses_critic(cfg) else None,
    }
