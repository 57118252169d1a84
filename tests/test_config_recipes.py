"""Recipes: valid, documented, and qwen3_4b_ppo matches the miles PPO example."""

from __future__ import annotations

import pytest

from ppo.config import global_batch_size, needs_ref, num_critic_only_steps, offload_train, uses_critic, validate
from ppo.recipes import DEFAULT_RECIPE, RECIPES, describe_recipes, qwen3_4b_ppo, tiny_ppo


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
    assert tiny.ppo == qwen.ppo
    assert (tiny.training.train_backend, tiny.engine.rollout_backend) == ("torch", "torch")
    assert tiny.placement.fake_gpus and tiny.placement.colocate
    assert tiny.checkpoint.hf_checkpoint == "generated:tiny-qwen3"
    assert tiny.rollout.prompt_data == "generated:arithmetic"
    assert tiny.reward.rm_type == "tiny_exact"
    assert global_batch_size(tiny) == 128


def test_describe_recipes_gives_name_and_first_doc_line():
    lines = describe_recipes().splitlines()
    assert len(lines) == len(RECIPES)
    for line, (name, fn) in zip(lines, RECIPES.items()):
        assert line.split()[0] == name
        assert line.endswith(fn.__doc__.strip().splitlines()[0])
