"""Typed PPO configuration: groups, validation, derived values, (de)serialisation and the CLI.

    from ppo.config import parse_args, needs_ref
    cfg = parse_args(["--recipe", "qwen3_4b_ppo", "--hf-checkpoint", "/models/Qwen3-4B"])

Configs are frozen and validated once; derived values (critic fallbacks, offloading, the
global batch size) are computed by the functions re-exported here, never written back.
"""

from ppo.config.cli import build_parser, parse_args, parse_cli
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
    eps_clip_high,
    global_batch_size,
    model_parallel_size,
    needs_ref,
    num_engines,
    offload_rollout,
    offload_train,
    rollout_num_gpus,
    rollout_offload_tags,
    samples_per_rollout,
    train_offload_tags,
    uses_critic,
)
from ppo.config.schema import (
    FIELDS,
    GENERATED_PREFIX,
    RM_TYPES,
    CheckpointConfig,
    ConfigError,
    EngineConfig,
    EvalConfig,
    LoggingConfig,
    OptimizerConfig,
    ParallelismConfig,
    PlacementConfig,
    PPOAlgoConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    TrainingConfig,
)
from ppo.config.serialize import from_dict, override, to_dict
from ppo.config.validate import ensure_valid, validate

__all__ = [
    "FIELDS", "GENERATED_PREFIX", "RM_TYPES",
    "CheckpointConfig", "ConfigError", "EngineConfig", "EvalConfig", "LoggingConfig", "OptimizerConfig",
    "OptimizerSettings", "ParallelismConfig", "PlacementConfig", "PPOAlgoConfig", "PPOConfig",
    "RewardConfig", "RolloutConfig", "TrainingConfig",
    "actor_gpus_per_node", "actor_num_gpus", "actor_optimizer", "build_parser", "critic_load", "critic_optimizer",
    "critic_save", "data_parallel_size", "derived_values", "ensure_valid", "eps_clip_high",
    "from_dict", "global_batch_size", "model_parallel_size", "needs_ref", "num_engines",
    "offload_rollout", "offload_train", "override", "parse_args", "parse_cli",
    "rollout_num_gpus", "rollout_offload_tags", "samples_per_rollout", "to_dict", "train_offload_tags",
    "uses_critic", "validate",
]
