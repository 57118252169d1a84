"""Each role's typed config, built from the run's PPOConfig: one function per role.

The roles own their configs (roles.trainer.config, roles.rollout.config, roles.reward.config)
and check them in __post_init__; these functions only say which run setting becomes which
role field, and resolve what the run derives (critic fallbacks, the lr decay length, the
engine's batch). A config travels to its role's process as itself (runtime.wire.register_config).
"""

from __future__ import annotations

from ppo import config as C
from ppo.config import PPOConfig
from roles.reward.config import RewardModelConfig, ScorerConfig
from roles.rollout.config import EngineConfig
from roles.trainer.config import TrainerConfig


def trainer_config(cfg: PPOConfig, hf_checkpoint: str, *, critic: bool, dtype: str) -> TrainerConfig:
    """The actor's or the critic's config (critic fallbacks applied): a MegatronTrainerConfig
    with --train-backend megatron, else a TrainerConfig."""
    opt = C.critic_optimizer(cfg) if critic else C.actor_optimizer(cfg)
    steps = cfg.rollout.num_rollout * max(1, C.samples_per_rollout(cfg) // C.global_batch_size(cfg))
    p, t = cfg.ppo, cfg.training
    dynamic = t.use_dynamic_batch_size
    common = dict(
        hf_checkpoint=hf_checkpoint, seed=t.seed, dtype=dtype,
        lr=opt.lr, min_lr=opt.min_lr, lr_decay_style=opt.lr_decay_style, lr_warmup_iters=opt.lr_warmup_iters,
        lr_decay_iters=None if opt.lr_decay_style == "constant" else max(1, steps - opt.lr_warmup_iters),
        weight_decay=opt.weight_decay, betas=(opt.adam_beta1, opt.adam_beta2), clip_grad=opt.clip_grad,
        global_batch_size=C.global_batch_size(cfg),
        micro_batch_size=None if dynamic else t.micro_batch_size,
        max_tokens_per_gpu=t.max_tokens_per_gpu if dynamic else None,
        eps_clip=p.eps_clip, eps_clip_high=p.eps_clip_high, eps_clip_c=p.eps_clip_c, ratio_level=C.ratio_level(cfg),
        value_clip=p.value_clip, loss_agg_mode=p.loss_agg_mode,
        # a KL loss at weight 0 changes nothing: skip the reference model entirely then; the
        # critic has no policy to hold near a reference (and keeps no reference copy)
        use_kl_loss=not critic and p.use_kl_loss and p.kl_loss_coef != 0, kl_loss_coef=p.kl_loss_coef,
        kl_loss_type=p.kl_loss_type, entropy_coef=p.entropy_coef, log_entropy=True,
        temperature=cfg.rollout.rollout_temperature, keep_ref=not critic and C.needs_ref(cfg),
    )
    if t.train_backend != "megatron":  # the torch backend's only recompute: HF checkpointing of every layer
        return TrainerConfig(**common, gradient_checkpointing=t.recompute_granularity == "full")
    # the megatron trainer builds its model parallelism and recompute from these (and refuses what it lacks)
    from roles.trainer.megatron.config import MegatronTrainerConfig  # imports no megatron-core; only when chosen

    par = cfg.parallelism
    return MegatronTrainerConfig(
        **common, tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size, context_parallel_size=par.context_parallel_size,
        recompute_granularity=t.recompute_granularity, recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers, transformer_impl=t.transformer_impl,
        offload_tags=C.train_offload_tags(cfg))


def scorer_config(cfg: PPOConfig) -> ScorerConfig:
    """The rule, custom-function or reward-service scorers' config (--rm-type, --custom-rm-path, --rm-url)."""
    r = cfg.reward
    return ScorerConfig(rm_type=r.rm_type, custom_rm_path=r.custom_rm_path, timeout_s=r.reward_timeout,
                        rm_url=r.rm_url, max_retries=r.rm_max_retries, max_concurrency=r.rm_max_concurrency,
                        reward_key=r.reward_key)


def reward_model_config(cfg: PPOConfig, *, dtype: str) -> RewardModelConfig:
    """A reward-model rank's config (--reward-model-path); call only when the run has one."""
    r = cfg.reward
    return RewardModelConfig(path=r.reward_model_path, dtype=dtype, max_tokens=r.reward_model_max_tokens_per_gpu)


def engine_config(cfg: PPOConfig, hf_checkpoint: str, *, engine_index: int, dtype: str) -> EngineConfig:
    """Engine `engine_index`'s config: batch, memory and backend options from the recipe
    (sglang: the `sglang.Engine` keywords miles would pass)."""
    e = cfg.engine
    common = dict(hf_checkpoint=hf_checkpoint, backend=e.rollout_backend, engine_index=engine_index,
                  seed=cfg.rollout.rollout_seed, dtype=dtype, max_request_retries=e.rollout_max_request_retries)
    if e.rollout_backend != "sglang":
        # the built-in engine takes the same share of a real GPU as sglang would; fake GPUs
        # and the CPU keep its default KV budget (max_batch_size full-context rows)
        import torch

        real_gpu = torch.cuda.is_available() and not cfg.placement.fake_gpus
        return EngineConfig(
            **common, max_batch_size=C.samples_per_rollout(cfg),
            mem_fraction=e.sglang_mem_fraction_static if real_gpu and e.sglang_mem_fraction_static else None,
            # the built-in engine's batch-invariant decode
            options={"batch_invariant": True} if e.sglang_enable_deterministic_inference else {})
    options = {"tp_size": e.rollout_num_gpus_per_engine}
    if C.offload_rollout(cfg):  # release/resume_memory_occupation work only with the memory saver
        options["enable_memory_saver"] = True
    if e.sglang_disable_cuda_graph:
        options["disable_cuda_graph"] = True
    if e.sglang_enable_deterministic_inference:  # the only mode in which per-request seeds hold
        options["enable_deterministic_inference"] = True
    return EngineConfig(**common, max_batch_size=e.sglang_max_running_requests or C.samples_per_rollout(cfg),
                        mem_fraction=e.sglang_mem_fraction_static, options=options)
