"""Each validation rule fires, naming the flag, the field and the value; all at once."""

from __future__ import annotations

import dataclasses

import pytest

from ppo.config import ConfigError, PPOConfig, ensure_valid, num_critic_only_steps, override, uses_critic, validate
from ppo.config.recipes import qwen3_4b_ppo, tiny_ppo

QWEN = qwen3_4b_ppo


def TINY():
    """tiny_ppo at fixed sizes (128 samples per rollout, global batch 64, 60 rollouts), so the
    expected messages below do not move when the recipe is retuned."""
    return override(tiny_ppo(), rollout_batch_size=32, n_samples_per_prompt=4, global_batch_size=64,
                    num_rollout=60, micro_batch_size=8)


def problems_of(base, **overrides) -> list[str]:
    return validate(override(base(), **overrides))


def assert_reported(problems: list[str], *fragments: str) -> None:
    assert any(all(f in p for f in fragments) for p in problems), (fragments, problems)


@pytest.mark.parametrize("base", [TINY, QWEN])
def test_recipes_are_valid(base):
    assert validate(base()) == []


def test_megatron_needs_no_torch_dist_checkpoint():
    """The megatron trainer starts from --hf-checkpoint through its own mapper, and the KL
    reference is the actor's initial weights: --ref-load is never read, so never required."""
    assert validate(override(QWEN(), ref_load=None, load=None)) == []
    assert validate(override(QWEN(), ref_load=None, use_kl_loss=True, kl_loss_coef=0.01)) == []


# (overrides on the tiny recipe, fragments one reported problem must contain)
FIELD_RULES = [
    ({"lr": 0.0}, ["--lr 0.0", "optimizer.lr", "must be > 0"]),
    ({"eps_clip": 1.0}, ["--eps-clip 1.0", "ppo.eps_clip", "in (0.0, 1.0)"]),
    ({"eps_clip": 0.0}, ["--eps-clip 0.0", "in (0.0, 1.0)"]),
    ({"eps_clip_high": -0.1}, ["--eps-clip-high -0.1", "ppo.eps_clip_high", "> 0"]),
    ({"eps_clip_c": 1.0}, ["--eps-clip-c 1.0", "ppo.eps_clip_c", "> 1.0"]),
    ({"gamma": 1.5}, ["--gamma 1.5", "ppo.gamma", "in [0.0, 1.0]"]),
    ({"lambd": -0.1}, ["--lambd -0.1", "ppo.lambd", "in [0.0, 1.0]"]),
    ({"value_clip": 0.0}, ["--value-clip 0.0", "ppo.value_clip"]),
    ({"kl_loss_coef": -1.0}, ["--kl-loss-coef -1.0", "ppo.kl_loss_coef", ">= 0"]),
    ({"kl_coef": -0.5}, ["--kl-coef -0.5", "ppo.kl_coef"]),
    ({"entropy_coef": -0.01}, ["--entropy-coef -0.01", "ppo.entropy_coef"]),
    ({"num_critic_only_steps": -1}, ["--num-critic-only-steps -1", ">= 0"]),
    ({"advantage_estimator": "dpo"}, ["--advantage-estimator 'dpo'", "one of: ppo, grpo, gspo"]),
    ({"tis_clip": 0.0}, ["--tis-clip 0.0", "ppo.tis_clip"]),
    ({"dynamic_sampling_max_extra_rounds": -1}, ["--dynamic-sampling-max-extra-rounds -1", ">= 0"]),
    ({"kl_loss_type": "k9"}, ["--kl-loss-type 'k9'", "one of: k1, k2, k3, low_var_kl"]),
    ({"loss_agg_mode": "sum"}, ["--loss-agg-mode 'sum'", "ppo.loss_agg_mode"]),
    ({"train_backend": "jax"}, ["--train-backend 'jax'", "one of: torch, megatron"]),
    ({"rollout_backend": "vllm"}, ["--rollout-backend 'vllm'", "one of: torch, sglang"]),
    ({"lr_decay_style": "step"}, ["--lr-decay-style 'step'", "optimizer.lr_decay_style"]),
    ({"adam_beta2": 1.0}, ["--adam-beta2 1.0", "in [0.0, 1.0)"]),
    ({"weight_decay": -0.1}, ["--weight-decay -0.1"]),
    ({"critic_lr": 0.0}, ["--critic-lr 0.0", "optimizer.critic_lr", "> 0"]),
    ({"critic_weight_decay": -1.0}, ["--critic-weight-decay -1.0"]),
    ({"critic_lr_warmup_iters": -2}, ["--critic-lr-warmup-iters -2"]),
    ({"rollout_temperature": -1.0}, ["--rollout-temperature -1.0", ">= 0"]),
    ({"rollout_top_p": 0.0}, ["--rollout-top-p 0.0", "in (0.0, 1.0]"]),
    ({"rollout_stop_token_ids": (3, -1)}, ["--rollout-stop-token-ids '3 -1'", ">= 0"]),
    ({"rollout_batch_size": 0}, ["--rollout-batch-size 0", "rollout.rollout_batch_size", ">= 1"]),
    ({"n_samples_per_prompt": 0}, ["--n-samples-per-prompt 0"]),
    ({"micro_batch_size": 0}, ["--micro-batch-size 0", "training.micro_batch_size"]),
    ({"sglang_mem_fraction_static": 1.0}, ["--sglang-mem-fraction-static 1.0", "in (0.0, 1.0)"]),
    ({"num_reward_workers": 0}, ["--num-reward-workers 0", "reward.num_reward_workers"]),
    ({"reward_timeout": 0.0}, ["--reward-timeout 0.0"]),
    ({"save_interval": 0, "save": "ck"}, ["--save-interval 0", "checkpoint.save_interval"]),
    ({"max_skipped_updates": -1}, ["--max-skipped-updates -1", "training.max_skipped_updates"]),
    ({"actor_num_gpus_per_node": 0}, ["--actor-num-gpus-per-node 0"]),
    ({"tensor_model_parallel_size": 0}, ["--tensor-model-parallel-size 0", ">= 1"]),
    ({"lr": "1e-3"}, ["--lr '1e-3'", "optimizer.lr", "expected float, got str"]),
    ({"use_kl_loss": 1}, ["--use-kl-loss 1", "expected bool, got int"]),
    ({"rollout_batch_size": 2.0}, ["--rollout-batch-size 2.0", "expected int"]),
    ({"input_key": None}, ["--input-key", "rollout.input_key", "must not be None"]),
    ({"recompute_granularity": "layer"},
     ["--recompute-granularity 'layer'", "training.recompute_granularity", "one of: full, selective"]),
    ({"recompute_method": "all", "recompute_granularity": "full", "recompute_num_layers": 1},
     ["--recompute-method 'all'", "training.recompute_method", "one of: uniform, block"]),
    ({"recompute_num_layers": 0, "recompute_granularity": "full", "recompute_method": "block"},
     ["--recompute-num-layers 0", "training.recompute_num_layers", ">= 1"]),
    ({"transformer_impl": "te"}, ["--transformer-impl 'te'", "one of: local, transformer_engine"]),
]


@pytest.mark.parametrize("overrides,fragments", FIELD_RULES, ids=[str(o) for o, _ in FIELD_RULES])
def test_field_rule_names_flag_field_and_allowed_values(overrides, fragments):
    assert_reported(problems_of(TINY, **overrides), *fragments)


# (base recipe, overrides, fragments one reported problem must contain)
CROSS_RULES = [
    (TINY, {"hf_checkpoint": None}, ["--hf-checkpoint", "checkpoint.hf_checkpoint", "required"]),
    (TINY, {"prompt_data": None}, ["--prompt-data", "rollout.prompt_data", "Please add"]),
    (TINY, {"rollout_batch_size": None}, ["--rollout-batch-size", "required"]),
    (TINY, {"num_rollout": None}, ["--num-rollout", "rollout.num_rollout", "required"]),
    (TINY, {"hf_checkpoint": "generated:huge"},
     ["--hf-checkpoint 'generated:huge'", "generated:tiny-qwen3"]),
    (TINY, {"prompt_data": "generated:poetry"},
     ["--prompt-data 'generated:poetry'", "generated:arithmetic"]),
    (TINY, {"rm_type": "gsm8k"}, ["--rm-type 'gsm8k'", "reward.rm_type", "one of: deepscaler"]),
    (TINY, {"rm_type": None}, ["--rm-type", "is not set", "--custom-rm-path"]),
    (TINY, {"rm_type": "remote_rm"}, ["--rm-type remote_rm needs", "Please add --rm-url http://"]),
    (TINY, {"rm_url": "http://h:1/r"},
     ["--rm-url 'http://h:1/r' (reward.rm_url) is set but --rm-type is not remote_rm",
      "Please add --rm-type remote_rm"]),
    (TINY, {"rm_type": "remote_rm", "rm_url": "h:1"}, ["--rm-url 'h:1'", "http://HOST[:PORT]/PATH"]),
    (TINY, {"rm_max_concurrency": 0}, ["--rm-max-concurrency 0", "reward.rm_max_concurrency"]),
    (TINY, {"reward_model_num_gpus": 1}, ["--reward-model-num-gpus 1", "is set but --reward-model-path is not"]),
    (TINY, {"reward_model_path": "/rm", "advantage_estimator": "grpo", "num_critic_only_steps": 0,
            "dynamic_sampling_filter_path": "ppo.generate.dynamic_sampling.check_reward_nonzero_std"},
     ["--dynamic-sampling-filter-path", "so is --reward-model-path", "before the reward model scores"]),
    (TINY, {"reward_model_path": "/rm", "rm_type": None},
     ["--eval-prompt-data", "eval sets are graded by rules", "--rule-reward-coef 0"]),
    (TINY, {"rollout_top_k": 0},
     ["--rollout-top-k 0", "rollout.rollout_top_k", "-1 (off) or >= 1"]),
    (TINY, {"use_kl_loss": False, "kl_loss_coef": 0.1},
     ["--kl-loss-coef 0.1", "is set but --use-kl-loss is not enabled. Please add --use-kl-loss"]),
    (TINY, {"kl_loss_coef": 0.1, "kl_coef": 0.05}, ["--kl-coef 0.05", "ppo.kl_coef", "both set"]),
    (TINY, {"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": False,
            "num_critic_only_steps": 0},
     ["--advantage-estimator 'reinforce_plus_plus'", "Please add --normalize-advantages"]),
    (TINY, {"advantage_estimator": "grpo", "n_samples_per_prompt": 1, "num_critic_only_steps": 0,
            "global_batch_size": 32},
     ["--n-samples-per-prompt 1", "rollout.n_samples_per_prompt", ">= 2"]),
    (TINY, {"advantage_estimator": "grpo", "num_critic_only_steps": 1},
     ["--num-critic-only-steps 1", "is set but --advantage-estimator is grpo",
      "Please add --advantage-estimator ppo"]),
    (TINY, {"use_tis": True, "use_rollout_logprobs": True},
     ["--use-rollout-logprobs (ppo.use_rollout_logprobs)", "Please remove one of --use-tis"]),
    (TINY, {"use_tis": True, "tis_clip_low": 2.0}, ["--tis-clip-low 2.0", "must be < --tis-clip 2.0"]),
    (TINY, {"custom_tis_function_path": "algorithms.mismatch:masked_is"},
     ["--custom-tis-function-path 'algorithms.mismatch:masked_is'", "Please add --use-tis"]),
    (TINY, {"over_sampling_batch_size": 128},
     ["--over-sampling-batch-size 128", "--dynamic-sampling-filter-path", "Please add"]),
    (TINY, {"over_sampling_batch_size": 1,
            "dynamic_sampling_filter_path": "ppo.generate.dynamic_sampling.check_reward_nonzero_std"},
     ["--over-sampling-batch-size 1", "must be >= --rollout-batch-size"]),
    (TINY, {"num_critic_only_steps": 60},
     ["--num-critic-only-steps 60", "< --num-rollout 60", "never trains"]),
    (TINY, {"min_lr": 0.01}, ["--min-lr 0.01", "optimizer.min_lr", "<= --lr 0.002"]),
    (TINY, {"lr": 0.01, "min_lr": 0.005}, ["--min-lr 0.005", "<= --critic-lr 0.001"]),
    (TINY, {"use_dynamic_batch_size": True},
     ["--use-dynamic-batch-size is set but --max-tokens-per-gpu", "training.max_tokens_per_gpu"]),
    (TINY, {"pipeline_model_parallel_size": 2},
     ["--pipeline-model-parallel-size 2", "needs --train-backend megatron"]),
    (TINY, {"rollout_num_gpus_per_engine": 2},
     ["--rollout-num-gpus-per-engine 2", "engine.rollout_num_gpus_per_engine",
      "--rollout-backend torch"]),
    (TINY, {"train_backend": "megatron", "ref_load": "x"},
     ["--fake-gpus (placement.fake_gpus) is set but --train-backend is 'megatron'",
      "Please add --train-backend torch"]),
    (TINY, {"rollout_backend": "sglang"},
     ["--fake-gpus", "--rollout-backend is 'sglang'", "Please add --rollout-backend torch"]),
    (TINY, {"actor_num_gpus_per_node": 4},
     ["--actor-num-gpus-per-node 4", "placement.actor_num_gpus_per_node",
      "<= --num-gpus-per-node 2"]),
    (QWEN, {"actor_num_gpus_per_node": 6},
     ["6 actor GPUs", "divisible by TP x PP x CP = 4", "--pipeline-model-parallel-size 2 x",
      "Please set --actor-num-gpus-per-node to a multiple of it"]),
    (TINY, {"offload_train_level": "params"},
     ["placement.offload_train_level", "'params'", "optimizer"]),
    (QWEN, {"rollout_num_gpus": 8},
     ["--rollout-num-gpus 8", "placement.rollout_num_gpus", "actor's 4 GPUs", "set it to 4"]),
    (QWEN, {"rollout_num_gpus_per_engine": 3},
     ["--rollout-num-gpus-per-engine 3", "must divide --actor-num-gpus-per-node 4"]),
    (QWEN, {"colocate": False},
     ["--rollout-num-gpus (placement.rollout_num_gpus) is not set",
      "Please add --rollout-num-gpus"]),
    (QWEN, {"colocate": False, "rollout_num_gpus": 6, "rollout_num_gpus_per_engine": 4},
     ["--rollout-num-gpus-per-engine 4", "must divide the 6 rollout GPUs"]),
    (QWEN, {"colocate": False, "rollout_num_gpus": 16, "rollout_num_gpus_per_engine": 16},
     ["--rollout-num-gpus-per-engine 16", "<= --num-gpus-per-node 4"]),
    (TINY, {"num_steps_per_rollout": 3, "global_batch_size": None},
     ["--num-steps-per-rollout 3", "ppo.num_steps_per_rollout", "must divide", "128 samples"]),
    (TINY, {"num_steps_per_rollout": 4},
     ["--global-batch-size 64", "= 32. Please set only one of the two"]),
    (TINY, {"global_batch_size": 96},
     ["= 128 samples must be divisible by the global batch size 96",
      "training.global_batch_size"]),
    (QWEN, {"global_batch_size": 1, "num_gpus_per_node": 8},
     ["global batch size 1", "divisible by the 2 data-parallel ranks"]),
    (TINY, {"micro_batch_size": 24},
     ["--micro-batch-size 24", "training.micro_batch_size", "2 data-parallel ranks"]),
    (TINY, {"save_interval": 5},
     ["--save-interval is set but --save (checkpoint.save) is not. Please add --save"]),
    (QWEN, {"recompute_method": "uniform"},
     ["--recompute-method 'uniform' (training.recompute_method) is set but --recompute-granularity",
      "Please add --recompute-granularity full"]),
    (QWEN, {"recompute_granularity": "full", "recompute_num_layers": 1},
     ["--recompute-granularity 'full'", "needs --recompute-method", "Please add --recompute-method uniform"]),
    (QWEN, {"recompute_granularity": "full", "recompute_method": "block"},
     ["--recompute-granularity 'full'", "Please add --recompute-num-layers"]),
    (QWEN, {"recompute_granularity": "selective", "recompute_num_layers": 2},
     ["--recompute-num-layers 2", "is 'selective'", "Please remove --recompute-num-layers"]),
    (TINY, {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
     ["--recompute-method 'block' (training.recompute_method)", "torch backend recomputes every whole layer only",
      "--train-backend megatron"]),
    (TINY, {"recompute_granularity": "selective"}, ["--recompute-granularity 'selective'", "torch backend"]),
    (TINY, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
     ["--recompute-num-layers 2 (training.recompute_num_layers)", "torch backend recomputes every whole layer"]),
    (TINY, {"offload_train_level": "optimizer", "offload_train": False},
     ["--offload-train-level 'optimizer' (placement.offload_train_level) is set but --offload-train is off",
      "Please remove --offload-train-level or add --offload-train"]),
    (TINY, {"offload_rollout_level": "kv_cache", "offload_rollout": False},
     ["--offload-rollout-level 'kv_cache' (placement.offload_rollout_level) is set but --offload-rollout "
      "is off", "Please remove --offload-rollout-level or add --offload-rollout"]),
    (QWEN, {"colocate": False, "rollout_num_gpus": 4, "advantage_estimator": "grpo",
            "num_critic_only_steps": 0, "offload_train_level": "optimizer"},
     ["--offload-train-level 'optimizer'", "--offload-train is off"]),
    (TINY, {"transformer_impl": "transformer_engine"},
     ["--transformer-impl 'transformer_engine' (training.transformer_impl)", "needs --train-backend megatron"]),
    (TINY, {"use_wandb": True},
     ["--use-wandb is set but --wandb-project", "Please add --wandb-project"]),
]


@pytest.mark.parametrize("base,overrides,fragments", CROSS_RULES,
                         ids=[str(o) for _, o, _ in CROSS_RULES])
def test_cross_field_rule_says_how_to_fix_it(base, overrides, fragments):
    assert_reported(problems_of(base, **overrides), *fragments)


def test_reward_level_kl_is_allowed_with_ppo():
    # miles rejects --kl-coef with a critic; Tandem computes ref log-probs before the values.
    assert problems_of(TINY, kl_coef=0.05, kl_loss_coef=0.0) == []
    assert problems_of(QWEN, kl_coef=0.05, kl_loss_coef=0.0) == []


def test_grpo_gspo_and_the_new_algorithms_run_on_the_recipe_with_no_other_flag():
    """Issue 24: --advantage-estimator grpo alone is valid (no critic: no critic warm-up)."""
    for estimator in ("grpo", "gspo"):
        cfg = override(tiny_ppo(), advantage_estimator=estimator)
        assert validate(cfg) == [] and num_critic_only_steps(cfg) == 0 and not uses_critic(cfg)
    assert num_critic_only_steps(tiny_ppo()) == 1  # the miles PPO example's warm-up, with the critic
    assert problems_of(TINY, num_critic_only_steps=0) == []
    assert problems_of(TINY, use_tis=True, get_mismatch_metrics=True,
                       custom_tis_function_path="algorithms.mismatch:masked_is") == []
    assert problems_of(TINY, use_rollout_logprobs=True) == []
    assert problems_of(TINY, advantage_estimator="grpo", over_sampling_batch_size=96,
                       dynamic_sampling_filter_path="ppo.generate.dynamic_sampling.check_reward_nonzero_std") == []


def test_custom_reward_function_replaces_rm_type():
    assert problems_of(TINY, rm_type="not-registered", custom_rm_path="my.rewards:score") == []


def test_a_reward_model_may_score_alone_or_beside_a_rule():
    assert problems_of(TINY, reward_model_path="/rm", reward_model_coef=0.5, reward_model_num_gpus=2) == []
    assert problems_of(TINY, reward_model_path="/rm", rm_type=None, eval_prompt_data=None, eval_interval=None) == []


def test_remote_rm_is_an_rm_type_beside_the_registry():
    assert problems_of(TINY, rm_type="remote_rm", rm_url="http://127.0.0.1:8000/reward", reward_key="score",
                       custom_reward_post_process_path="my.rewards:post") == []


def test_rm_types_come_from_the_registry_passed_in():
    cfg = override(tiny_ppo(), rm_type="remote")
    assert validate(cfg, rm_types=("remote",)) == []
    assert_reported(validate(cfg, rm_types=("exact",)), "--rm-type 'remote'", "one of: exact")


def test_colocate_turns_offloading_on_without_a_flag():
    assert problems_of(TINY, offload_train=None, offload_rollout=None) == []
    assert problems_of(TINY, offload_train=True, offload_rollout=True) == []
    # colocated roles may keep their memory beside each other (one-GPU plans)
    assert problems_of(TINY, offload_train=False, offload_rollout=False) == []


def test_one_gpu_bench_plans_are_valid():
    # bench/qwen3_4b_one_gpu.sh: the PPO plan keeps offload_train on (colocated, with a critic)
    one_gpu = dict(num_gpus_per_node=1, actor_num_gpus_per_node=1, pipeline_model_parallel_size=1,
                   context_parallel_size=1, rollout_backend="torch")
    assert problems_of(QWEN, **one_gpu, offload_train_level="optimizer", offload_rollout=False) == []
    assert problems_of(QWEN, **one_gpu, advantage_estimator="grpo", num_critic_only_steps=0,
                       offload_train=False, offload_rollout=False) == []


def test_several_problems_are_reported_together():
    problems = problems_of(TINY, lr=-1.0, gamma=2.0, rm_type="nope", use_wandb=True,
                           offload_train_level="params", global_batch_size=96)
    for fragment in ("--lr -1.0", "--gamma 2.0", "--rm-type 'nope'", "--use-wandb",
                     "offload_train_level", "divisible by the global batch size 96"):
        assert_reported(problems, fragment)
    assert len(problems) == 6


def test_ensure_valid_raises_one_config_error_carrying_the_list():
    with pytest.raises(ConfigError) as info:
        ensure_valid(override(tiny_ppo(), lr=0.0, eps_clip=3.0))
    assert isinstance(info.value, ValueError)
    assert len(info.value.problems) == 2
    assert "2 problems" in str(info.value) and "--eps-clip 3.0" in str(info.value)


def test_default_config_reports_what_is_required():
    problems = validate(PPOConfig())
    for flag in ("--hf-checkpoint", "--prompt-data", "--rollout-batch-size", "--num-rollout",
                 "--rm-type", "--rollout-num-gpus"):
        assert_reported(problems, flag)


def test_validate_never_mutates_the_config():
    cfg = override(qwen3_4b_ppo(), offload_train=None, rollout_num_gpus=None)
    before = dataclasses.asdict(cfg)
    assert validate(cfg) == []
    assert dataclasses.asdict(cfg) == before
