"""Recipes: valid, documented, and qwen3_4b_ppo matches the miles PPO example."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

import launch
from ppo.config.cli import parse_args
from ppo.config import (
    derived_values,
    global_batch_size,
    needs_ref,
    num_critic_only_steps,
    offload_rollout,
    offload_train,
    override,
    train_offload_tags,
    uses_critic,
    validate,
)
from ppo.config.recipes import DEFAULT_RECIPE, RECIPES, describe_recipes, qwen3_4b_ppo, qwen3_4b_ppo_1gpu, tiny_ppo


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_valid_and_documented(name):
    fn = RECIPES[name]
    assert validate(fn()) == []
    assert fn.__doc__ and fn.__doc__.strip().splitlines()[0]
    assert fn() == fn() and fn() is not fn()  # a fresh config each call


def test_default_recipe_is_tiny():
    assert DEFAULT_RECIPE == "tiny_ppo"


def test_qwen3_4b_ppo_follows_the_miles_example():
    cfg = qwen3_4b_ppo()
    r, p, o, t = cfg.rollout, cfg.ppo, cfg.optimizer, cfg.training
    assert (r.rollout_batch_size, r.n_samples_per_prompt) == (8, 8)
    assert r.rollout_max_response_len == 8192
    assert (r.rollout_temperature, r.num_rollout, r.rollout_shuffle) == (0.8, 300, True)
    assert (r.input_key, r.label_key, r.apply_chat_template) == ("prompt", "label", True)
    assert r.prompt_data.endswith("dapo-math-17k.jsonl")
    assert cfg.reward.rm_type == "deepscaler"
    assert (p.advantage_estimator, num_critic_only_steps(cfg)) == ("ppo", 1)
    assert p.normalize_advantages
    assert (p.use_kl_loss, p.kl_loss_coef, p.kl_loss_type, p.kl_coef) == (True, 0.0, "k1", 0.0)
    assert (p.entropy_coef, p.eps_clip, p.eps_clip_high) == (0.0, 0.2, None)
    assert (o.optimizer, o.lr, o.critic_lr, o.lr_decay_style) == ("adam", 1e-6, 1e-5, "constant")
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2) == (0.1, 0.9, 0.98)
    assert (t.train_backend, t.global_batch_size, t.use_dynamic_batch_size,
            t.max_tokens_per_gpu) == ("megatron", 32, True, 16384)
    par = cfg.parallelism
    assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
            par.context_parallel_size) == (1, 2, 2)
    e = cfg.engine
    assert (e.rollout_backend, e.rollout_num_gpus_per_engine, e.sglang_mem_fraction_static,
            e.sglang_max_running_requests) == ("sglang", 1, 0.8, 512)
    pl = cfg.placement
    assert (pl.actor_num_nodes, pl.actor_num_gpus_per_node, pl.num_gpus_per_node, pl.colocate) == (1, None, 4, True)
    assert uses_critic(cfg) and offload_train(cfg) and not needs_ref(cfg)
    assert cfg.checkpoint.save_interval == 20


def test_tiny_ppo_runs_the_same_algorithm_on_fake_gpus():
    tiny, qwen = tiny_ppo(), qwen3_4b_ppo()
    # the same algorithm, plus a KL loss to the warm start (without it the held-out sums stall)
    assert tiny.ppo == dataclasses.replace(qwen.ppo, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    assert (tiny.training.train_backend, tiny.engine.rollout_backend) == ("torch", "torch")
    assert tiny.placement.fake_gpus and tiny.placement.colocate
    assert tiny.checkpoint.hf_checkpoint == "generated:tiny-qwen3"
    assert tiny.rollout.prompt_data == "generated:column_sums_small"
    assert tiny.reward.rm_type == "tiny_digits"
    assert global_batch_size(tiny) == 128


def test_describe_recipes_gives_name_and_first_doc_line():
    lines = describe_recipes().splitlines()
    assert len(lines) == len(RECIPES)
    for line, (name, fn) in zip(lines, RECIPES.items()):
        assert line.split()[0] == name
        assert line.endswith(fn.__doc__.strip().splitlines()[0])


# What bench/qwen3_4b_one_gpu.sh passed before qwen3_4b_ppo_1gpu existed (its COMMON flags, then
# its plans by response length), and what it passes now on top of the recipe.
SCRIPT_COMMON_BEFORE = (
    "--recipe", "qwen3_4b_ppo", "--load", "none", "--save", "none", "--save-interval", "none",
    "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1",
    "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1", "--rollout-backend", "torch",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--log-format", "plain")
SCRIPT_COMMON_NOW = ("--recipe", "qwen3_4b_ppo_1gpu", "--load", "none", "--save", "none",
                     "--save-interval", "none", "--log-format", "plain")
SCRIPT_PLANS = {  # name: (flags before, flags now); both pass FULL's length and warm-up
    "ppo 2048": (("--offload-train-level", "optimizer", "--no-offload-rollout",
                  "--sglang-mem-fraction-static", "0.22"), ()),
    "grpo 2048": (("--advantage-estimator", "grpo", "--no-offload-train", "--no-offload-rollout",
                   "--sglang-mem-fraction-static", "0.22"), ("--advantage-estimator", "grpo", "--no-offload-train",
                                                            "--offload-train-level", "all")),
    "ppo 8192": (("--offload-train-level", "optimizer", "--offload-rollout-level", "kv_cache",
                  "--sglang-mem-fraction-static", "0.62"),
                 ("--offload-rollout", "--offload-rollout-level", "kv_cache", "--sglang-mem-fraction-static", "0.62")),
}
SCRIPT_PLANS["grpo 8192"] = tuple(("--advantage-estimator", "grpo", *flags) for flags in SCRIPT_PLANS["ppo 8192"])


@pytest.mark.parametrize("plan", sorted(SCRIPT_PLANS))
def test_qwen3_4b_ppo_1gpu_is_what_the_one_gpu_bench_passed_as_flags(plan):
    before, now = SCRIPT_PLANS[plan]
    length = ("--rollout-max-response-len", plan.split()[1], "--num-critic-only-steps", "0", "--run-dir", "r")
    old = parse_args([*SCRIPT_COMMON_BEFORE, *before, *length])
    new = parse_args([*SCRIPT_COMMON_NOW, *now, *length])
    # Before, the 8192 plan left --offload-rollout unset, which colocation turns on.
    assert override(new, offload_rollout=old.placement.offload_rollout) == old
    assert derived_values(new) == derived_values(old)


def test_qwen3_4b_ppo_1gpu_is_qwen3_4b_ppo_on_one_gpu():
    cfg, base = qwen3_4b_ppo_1gpu(), qwen3_4b_ppo()
    assert validate(cfg) == []
    assert (cfg.ppo, cfg.optimizer, cfg.reward) == (base.ppo, base.optimizer, base.reward)
    assert cfg.rollout == override(base, rollout_max_response_len=2048).rollout
    assert (cfg.placement.num_gpus_per_node, cfg.placement.actor_num_gpus_per_node) == (1, 1)
    assert cfg.placement.colocate and cfg.engine.rollout_backend == "torch"
    # both trainers keep their weights on the GPU; the engine keeps everything
    assert train_offload_tags(cfg) == ("grads", "optimizer")
    assert not offload_rollout(cfg)
    assert cfg.checkpoint.save.startswith("runs/qwen3_4b_ppo_1gpu/")


def test_dry_run_places_qwen3_4b_ppo_1gpu_on_gpu_0(capsys):
    launch.main(["--recipe", "qwen3_4b_ppo_1gpu", "--dry-run"])
    out = capsys.readouterr().out
    placement = out[out.rindex("}") + 1:].split("\n")
    assert any(line.split()[:2] == ["actor", "0"] and line.endswith("tp 1 x pp 1 x cp 1 x dp 1")
               for line in placement)
    assert [line.split()[:3] for line in placement if line.startswith("engine")] == [["engine", "0", "0"]]


def test_config_imports_neither_the_recipes_nor_the_command_line_built_on_it():
    code = "import sys, ppo.config; print(sorted({'ppo.config.recipes', 'ppo.config.cli'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
