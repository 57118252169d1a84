"""plan_placement: which GPU ids actor, critic and engines get, for any GPU count."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ppo.config import override, validate
from ppo.gpu.placement import format_placement, plan_placement
from ppo.config.recipes import qwen3_4b_ppo, tiny_ppo


def qwen_on_eight_gpus():
    """qwen3_4b_ppo (4 GPUs as miles ships it) on a node of 8: the actor takes them all."""
    return override(qwen3_4b_ppo(), num_gpus_per_node=8)


def test_qwen_recipe_colocates_everything_on_eight_gpus():
    plan = plan_placement(qwen_on_eight_gpus())
    assert plan.actor_gpus == list(range(8))
    assert plan.critic_gpus == list(range(8))
    assert plan.engines == [[g] for g in range(8)]
    assert (plan.num_nodes, plan.num_reward_workers, plan.fake_gpus) == (1, 1, False)


def test_tiny_recipe_uses_two_fake_gpus():
    plan = plan_placement(tiny_ppo())
    assert plan.actor_gpus == plan.critic_gpus == [0, 1]
    assert plan.engines == [[0], [1]]
    assert plan.fake_gpus and plan.num_nodes == 1


def test_colocated_engines_tile_the_actor_gpus_across_nodes():
    cfg = override(qwen_on_eight_gpus(), actor_num_nodes=2, rollout_num_gpus_per_engine=4)
    plan = plan_placement(cfg)
    assert plan.actor_gpus == list(range(16)) and plan.num_nodes == 2
    assert plan.engines == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert (plan.node_of(13), plan.local_gpu(13)) == (1, 5)


def test_grpo_has_no_critic():
    cfg = override(tiny_ppo(), advantage_estimator="grpo", num_critic_only_steps=0)
    assert plan_placement(cfg).critic_gpus == []


def test_separate_engines_fill_the_free_gpus_after_the_actor():
    cfg = override(qwen_on_eight_gpus(), colocate=False, actor_num_gpus_per_node=4,
                   rollout_num_gpus=4, rollout_num_gpus_per_engine=2, global_batch_size=32)
    plan = plan_placement(cfg)
    assert plan.actor_gpus == [0, 1, 2, 3]
    assert plan.engines == [[4, 5], [6, 7]]
    assert plan.num_nodes == 1


def test_separate_engines_never_straddle_a_node():
    cfg = override(qwen_on_eight_gpus(), colocate=False, actor_num_nodes=2, actor_num_gpus_per_node=6,
                   rollout_num_gpus=8, rollout_num_gpus_per_engine=4,
                   pipeline_model_parallel_size=1, context_parallel_size=3, global_batch_size=16)
    assert validate(cfg) == []
    plan = plan_placement(cfg)
    assert plan.actor_gpus == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]
    # nodes 0 and 1 keep only 2 free GPUs each: too few for a 4-GPU engine
    assert plan.engines == [[16, 17, 18, 19], [20, 21, 22, 23]]
    assert plan.num_nodes == 3


@settings(max_examples=150, deadline=None)
@given(nodes=st.integers(1, 3), per_node=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_any_valid_placement_is_consistent(nodes, per_node, data):
    actor_per_node = data.draw(st.integers(1, per_node))
    colocate = data.draw(st.booleans())
    per_engine = data.draw(st.sampled_from([e for e in (1, 2, 4, 8) if e <= per_node]))
    rollout_gpus = per_engine * data.draw(st.integers(1, 6))
    cfg = override(qwen3_4b_ppo(), actor_num_nodes=nodes, actor_num_gpus_per_node=actor_per_node,
                   num_gpus_per_node=per_node, colocate=colocate,
                   rollout_num_gpus=None if colocate else rollout_gpus,
                   rollout_num_gpus_per_engine=per_engine, pipeline_model_parallel_size=1,
                   context_parallel_size=1, global_batch_size=64, rollout_batch_size=8 * 8 * 3)
    if validate(cfg):
        return  # e.g. engines that cannot tile the actor's GPUs of a node
    plan = plan_placement(cfg)
    assert len(plan.actor_gpus) == nodes * actor_per_node == len(set(plan.actor_gpus))
    assert plan.critic_gpus == plan.actor_gpus
    engine_gpus = [g for e in plan.engines for g in e]
    assert len(engine_gpus) == len(set(engine_gpus))  # no GPU serves two engines
    assert all(len(e) == per_engine for e in plan.engines)
    assert all(len({plan.node_of(g) for g in e}) == 1 for e in plan.engines)
    if colocate:
        assert sorted(engine_gpus) == plan.actor_gpus
    else:
        assert len(engine_gpus) == rollout_gpus and not set(engine_gpus) & set(plan.actor_gpus)
    assert plan.num_nodes == max(map(plan.node_of, plan.actor_gpus + engine_gpus)) + 1


def test_table_lists_every_role():
    table = format_placement(plan_placement(qwen_on_eight_gpus()))
    lines = table.splitlines()
    # the trainers are rank groups: one process per GPU, qwen3_4b_ppo's TP x PP x CP x DP layout
    assert lines[1].split() == ["actor", "0-7", "0", "8", "ranks:", "tp", "1", "x", "pp", "2", "x", "cp", "2",
                                "x", "dp", "2"]
    assert lines[2].split()[:4] == ["critic", "0-7", "0", "8"]
    assert lines[3].split() == ["engine", "0", "0", "0", "1"]
    assert "engine 7" in table and "cpu x 1" in table
    assert lines[-1] == "1 node(s) x 8 GPUs"


def test_torch_trainers_show_their_data_parallel_ranks():
    table = format_placement(plan_placement(tiny_ppo()))
    assert table.splitlines()[1].split() == ["actor", "0-1", "0", "2", "ranks:", "dp", "2"]
