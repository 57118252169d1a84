"""CLI parsing, derived values (critic fallbacks, needs_ref, offloading) and JSON round trips."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ppo.config import (
    FIELDS,
    ConfigError,
    actor_optimizer,
    critic_load,
    critic_optimizer,
    critic_save,
    data_parallel_size,
    eps_clip_high,
    from_dict,
    global_batch_size,
    needs_ref,
    offload_rollout,
    offload_train,
    override,
    to_dict,
    uses_critic,
)
from ppo.config.cli import parse_args
from ppo.config.recipes import RECIPES, qwen3_4b_ppo, tiny_ppo


def test_no_arguments_mean_the_tiny_recipe_in_a_fresh_run_dir():
    cfg = parse_args([])
    assert cfg.logging.run_dir.startswith("runs/tiny_ppo-")
    assert override(cfg, run_dir=tiny_ppo().logging.run_dir) == tiny_ppo()
    assert parse_args(["--run-dir", "x"]).logging.run_dir == "x"


def test_recipe_then_flags_override_it():
    cfg = parse_args(["--recipe", "qwen3_4b_ppo", "--hf-checkpoint", "/m/Qwen3-4B",
                      "--lr", "2e-6", "--rollout-batch-size", "16", "--rm-type", "dapo"])
    assert cfg.checkpoint.hf_checkpoint == "/m/Qwen3-4B"
    assert cfg.optimizer.lr == 2e-6 and isinstance(cfg.optimizer.lr, float)
    assert cfg.rollout.rollout_batch_size == 16
    assert cfg.reward.rm_type == "dapo"
    assert cfg == override(qwen3_4b_ppo(), hf_checkpoint="/m/Qwen3-4B", lr=2e-6,
                           rollout_batch_size=16, rm_type="dapo", run_dir=cfg.logging.run_dir)


def test_bool_flags_take_positive_and_negative_forms():
    # tiny_ppo weighs its KL loss at 0.1: turning the loss off takes its weight with it
    assert parse_args(["--no-use-kl-loss", "--kl-loss-coef", "0"]).ppo.use_kl_loss is False
    assert parse_args(["--no-use-kl-loss", "--use-kl-loss"]).ppo.use_kl_loss is True
    assert parse_args(["--no-normalize-advantages"]).ppo.normalize_advantages is False
    assert parse_args(["--dump-samples"]).logging.dump_samples is True


def test_tristate_offload_flags_stay_unset_until_given():
    assert tiny_ppo().placement.offload_train is None
    assert parse_args(["--offload-train"]).placement.offload_train is True


def test_optional_fields_accept_none_and_int_lists():
    cfg = parse_args(["--eps-clip-c", "3", "--rollout-stop-token-ids", "1", "7"])
    assert cfg.ppo.eps_clip_c == 3.0
    assert cfg.rollout.rollout_stop_token_ids == (1, 7)
    cfg = parse_args(["--recipe", "qwen3_4b_ppo", "--sglang-max-running-requests", "None",
                      "--rollout-stop-token-ids", "none"])
    assert cfg.engine.sglang_max_running_requests is None
    assert cfg.rollout.rollout_stop_token_ids is None


def test_negative_numbers_are_values_not_flags():
    assert parse_args(["--rollout-top-k", "-1"]).rollout.rollout_top_k == -1


def test_cli_reports_every_problem_in_one_error():
    with pytest.raises(ConfigError) as info:
        parse_args(["--bogus", "1", "--lr", "fast", "--rollout-batch-size", "2.5",
                    "--eps-clip", "0", "--rollout-batch-szie", "3", "--rm-type", "nope"])
    problems = info.value.problems
    assert "--bogus: unknown flag" in problems
    assert "--rollout-batch-szie: unknown flag; did you mean --rollout-batch-size?" in problems
    assert "--lr 'fast' (optimizer.lr): expected a float" in problems
    assert "--rollout-batch-size '2.5' (rollout.rollout_batch_size): expected an int" in problems
    assert any(p.startswith("--eps-clip 0.0 (ppo.eps_clip): must be in (0.0, 1.0)")
               for p in problems)
    assert any(p.startswith("--rm-type 'nope'") for p in problems)
    assert len(problems) == 6


def test_cli_rejects_abbreviations_stray_words_and_missing_values():
    with pytest.raises(ConfigError, match="--rollout-batch: unknown flag"):
        parse_args(["--rollout-batch", "8"])
    with pytest.raises(ConfigError, match="'stray': unexpected argument"):
        parse_args(["stray"])
    with pytest.raises(ConfigError, match="--lr: expected one argument"):
        parse_args(["--lr"])
    with pytest.raises(ConfigError, match=f"--recipe 'nope': must be one of: {', '.join(RECIPES)}$"):
        parse_args(["--recipe", "nope"])


def test_every_field_has_a_flag_named_like_miles():
    assert FIELDS["rollout_batch_size"].flag == "--rollout-batch-size"
    assert FIELDS["rollout_batch_size"].path == "rollout.rollout_batch_size"
    assert FIELDS["num_critic_only_steps"].path == "ppo.num_critic_only_steps"
    assert len(FIELDS) == sum(len(dataclasses.fields(getattr(tiny_ppo(), f.name)))
                              for f in dataclasses.fields(tiny_ppo()))


def test_config_is_frozen():
    cfg = tiny_ppo()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.lr = 1.0  # type: ignore[misc]


def test_critic_optimizer_falls_back_to_the_actor():
    cfg = override(tiny_ppo(), lr=3e-4, weight_decay=0.05, lr_warmup_iters=7, critic_lr=None)
    assert critic_optimizer(cfg) == actor_optimizer(cfg)
    cfg = override(cfg, critic_lr=1e-2)
    assert critic_optimizer(cfg).lr == 1e-2
    assert critic_optimizer(cfg).weight_decay == 0.05 and critic_optimizer(cfg).lr_warmup_iters == 7
    cfg = override(cfg, critic_weight_decay=0.0, critic_lr_warmup_iters=0)
    assert (critic_optimizer(cfg).weight_decay, critic_optimizer(cfg).lr_warmup_iters) == (0.0, 0)
    assert actor_optimizer(cfg).lr == 3e-4 and cfg.optimizer.critic_lr == 1e-2  # nothing rewritten


def test_critic_checkpoint_paths_fall_back_to_siblings_never_the_actors_folder():
    cfg = override(tiny_ppo(), load="ck/actor", save="ck/run/")
    assert critic_load(cfg) == "ck/actor_critic"
    assert critic_save(cfg) == "ck/run_critic"
    cfg = override(cfg, critic_load="c/in", critic_save="c/out")
    assert (critic_load(cfg), critic_save(cfg)) == ("c/in", "c/out")
    assert critic_save(tiny_ppo()) is None


@pytest.mark.parametrize("use_kl_loss,kl_loss_coef,kl_coef,expected", [
    (False, 0.0, 0.0, False),
    (True, 0.0, 0.0, False),  # the miles example: KL loss wired in at weight 0
    (True, 0.01, 0.0, True),
    (False, 0.0, 0.05, True),  # reward-level KL
])
def test_needs_ref_only_when_a_kl_term_is_on(use_kl_loss, kl_loss_coef, kl_coef, expected):
    cfg = override(tiny_ppo(), use_kl_loss=use_kl_loss, kl_loss_coef=kl_loss_coef, kl_coef=kl_coef)
    assert needs_ref(cfg) is expected


def test_only_the_actor_takes_the_kl_loss_and_keeps_a_reference():
    """A KL loss at a weight above 0 once started the critic with use_kl_loss and no
    reference copy, which its config refuses: every PPO run with --kl-loss-coef died at start."""
    from ppo.setup.role_configs import trainer_config

    cfg = override(tiny_ppo(), kl_loss_coef=0.01)
    actor, critic = (trainer_config(cfg, "ckpt", critic=c, dtype="float32") for c in (False, True))
    assert actor.use_kl_loss and actor.keep_ref
    assert not critic.use_kl_loss and not critic.keep_ref


def test_uses_critic_follows_the_estimator():
    assert uses_critic(tiny_ppo())
    assert not uses_critic(override(tiny_ppo(), advantage_estimator="grpo"))


def test_offloading_is_derived_from_colocation_and_the_critic():
    tiny = tiny_ppo()
    assert offload_train(tiny) and offload_rollout(tiny)
    apart = override(qwen3_4b_ppo(), colocate=False, rollout_num_gpus=8)
    assert offload_train(apart)  # actor and critic share the train GPUs
    assert not offload_rollout(apart)
    assert not offload_train(override(apart, advantage_estimator="grpo"))
    assert not offload_train(override(apart, offload_train=False))


def test_global_batch_size_and_eps_clip_high_resolve():
    cfg = tiny_ppo()  # 128 prompts x 8 samples, global batch 128
    assert global_batch_size(cfg) == 128
    assert global_batch_size(override(cfg, global_batch_size=None)) == 1024
    assert global_batch_size(override(cfg, global_batch_size=None, num_steps_per_rollout=8)) == 128
    assert eps_clip_high(cfg) == 0.2 and eps_clip_high(override(cfg, eps_clip_high=0.28)) == 0.28
    assert data_parallel_size(qwen3_4b_ppo()) == 1  # TP1 x PP2 x CP2 over 4 GPUs
    assert data_parallel_size(override(qwen3_4b_ppo(), num_gpus_per_node=8)) == 2


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_json_round_trip(name):
    cfg = override(RECIPES[name](), rollout_stop_token_ids=(5, 9), eps_clip_c=3.0)
    text = json.dumps(to_dict(cfg))
    assert from_dict(json.loads(text)) == cfg


def test_from_dict_rejects_unknown_and_misplaced_keys():
    d = to_dict(tiny_ppo())
    d["optimizer"]["momentum"] = 0.9
    d["rollout"]["lr"] = 1.0
    d["extras"] = {}
    with pytest.raises(ConfigError) as info:
        from_dict(d)
    assert sorted(info.value.problems) == [
        "'extras': unknown config group; allowed: checkpoint, rollout, reward, ppo, optimizer, "
        "training, parallelism, engine, placement, cluster, logging, evaluation, tools, generate",
        "optimizer.momentum: unknown config key",
        "rollout.lr: unknown config key (it belongs to optimizer.lr)",
    ]


def test_from_dict_validates_values_and_fills_missing_keys():
    d = to_dict(tiny_ppo())
    d["optimizer"]["lr"] = "fast"
    with pytest.raises(ConfigError, match=r"--lr 'fast' \(optimizer.lr\): expected float"):
        from_dict(d)
    d = to_dict(tiny_ppo())
    del d["logging"]["dump_samples"]
    d["optimizer"]["clip_grad"] = 1  # an int where a float belongs
    cfg = from_dict(d)
    assert cfg.logging.dump_samples is True and isinstance(cfg.optimizer.clip_grad, float)


def test_override_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="learning_rate: unknown config field"):
        override(tiny_ppo(), learning_rate=1.0)


def test_recompute_flags_reach_the_trainer_configs():
    """miles' --recompute-* flags land in MegatronTrainerConfig (megatron) and turn on HF
    checkpointing of every layer (torch backend)."""
    from ppo.setup.role_configs import trainer_config
    from roles.trainer import TrainerConfig
    from roles.trainer.megatron import MegatronTrainerConfig

    one_gpu_layout = ["--pipeline-model-parallel-size", "1", "--context-parallel-size", "1"]
    flags = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "6"]
    cfg = parse_args(["--recipe", "qwen3_4b_ppo", *one_gpu_layout, *flags])
    for critic in (False, True):
        mt = trainer_config(cfg, "ckpt", critic=critic, dtype="bfloat16")
        assert type(mt) is MegatronTrainerConfig
        assert (mt.recompute_granularity, mt.recompute_method, mt.recompute_num_layers) == ("full", "block", 6)
    plain = trainer_config(parse_args(["--recipe", "qwen3_4b_ppo", *one_gpu_layout]), "ckpt", critic=False,
                           dtype="bfloat16")
    assert plain.recompute_granularity is None and plain.transformer_impl == "local"
    assert plain.offload_tags == ("params", "grads", "optimizer")  # the tags the plan offloads each iteration
    keep_weights = parse_args(["--recipe", "qwen3_4b_ppo", *one_gpu_layout, "--offload-train-level", "optimizer"])
    assert trainer_config(keep_weights, "ckpt", critic=False, dtype="bfloat16").offload_tags == ("grads", "optimizer")
    te = parse_args(["--recipe", "qwen3_4b_ppo", *one_gpu_layout, "--transformer-impl", "transformer_engine"])
    assert trainer_config(te, "ckpt", critic=True, dtype="bfloat16").transformer_impl == "transformer_engine"

    torch_flags = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    for argv, expected in (([], False), (torch_flags, True)):
        tc = trainer_config(parse_args(["--recipe", "tiny_ppo", *argv]), "ckpt", critic=False, dtype="float32")
        assert type(tc) is TrainerConfig
        assert tc.gradient_checkpointing is expected
