"""Typed PPO configuration: groups, validation, derived values and (de)serialisation.

    from ppo.config import needs_ref, override, validate
    from ppo.config.recipes import qwen3_4b_ppo
    cfg = override(qwen3_4b_ppo(), hf_checkpoint="/models/Qwen3-4B")
    assert validate(cfg) == [] and not needs_ref(cfg)

Recipes (ppo.config.recipes) build on this package, and the command line (ppo.config.cli) on both.
Configs are frozen and validated once; derived values (critic fallbacks, offloading, the
global batch size) are computed by the functions re-exported here, never written back.
"""

from ppo.config.derived import (
    OptimizerSettings,
    actor_gpus_per_node,
    actor_num_gpus,
    actor_optimizer,
    critic_load,
    critic_optimizer,
    critic_save,
    data_parallel_size,
    derived_values,
    engines_discard_weights,
    eps_clip_high,
    global_batch_size,
    model_parallel_size,
    needs_ref,
    num_critic_only_steps,
    num_engines,
    offload_rollout,
    over_sampling_batch_size,
    offload_train,
    ratio_level,
    rollout_num_gpus,
    rollout_offload_tags,
    samples_per_rollout,
    side_by_side,
    train_offload_tags,
    use_tis,
    uses_critic,
)
from ppo.config.schema import (
    FIELDS,
    GENERATED_PREFIX,
    RM_TYPES,
    CheckpointConfig,
    ClusterConfig,
    ConfigError,
    EngineConfig,
    EvalConfig,
    GenerateConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelismConfig,
    PlacementConfig,
    PPOAlgoConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    ToolsConfig,
    TrainingConfig,
)
from ppo.config.serialize import from_dict, override, to_dict
from ppo.config.validate import ensure_valid, validate

__all__ = [
    "FIELDS", "GENERATED_PREFIX", "RM_TYPES",
    "CheckpointConfig", "ClusterConfig", "ConfigError", "EngineConfig", "EvalConfig", "GenerateConfig", "LoggingConfig", "OptimizerConfig",
    "OptimizerSettings", "ParallelismConfig", "PlacementConfig", "PPOAlgoConfig", "PPOConfig",
    "RewardConfig", "RolloutConfig", "ToolsConfig", "TrainingConfig",
    "actor_gpus_per_node", "actor_num_gpus", "actor_optimizer", "critic_load", "critic_optimizer",
    "critic_save", "data_parallel_size", "derived_values", "engines_discard_weights", "ensure_valid", "eps_clip_high",
    "from_dict", "global_batch_size", "model_parallel_size", "needs_ref", "num_critic_only_steps",
    "num_engines", "offload_rollout", "offload_train", "over_sampling_batch_size", "override",
    "ratio_level", "rollout_num_gpus", "rollout_offload_tags", "samples_per_rollout", "side_by_side", "to_dict", "train_offload_tags",
    "use_tis", "uses_critic", "validate",
]
