"""Which global GPU ids the actor, the engines and a reward model take: the one rule that both
the placement (ppo.gpu.placement) and the cluster checks of `validate` (how many nodes a
run spans) read, so it lives below both.

GPU ids are global: GPU `g` is local device `g % num_gpus_per_node` of node
`g // num_gpus_per_node`. The actor takes its GPUs node by node. Colocated engines tile the
actor's GPUs; otherwise they take the free GPUs after the actor's, never straddling a node.
A reward model has one rank per GPU, on the engines' GPUs or, with --reward-model-num-gpus N,
on N free GPUs of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo.config.derived import actor_gpus_per_node, num_engines
from ppo.config.schema import PPOConfig


@dataclass(frozen=True, kw_only=True)
class GpuLayout:
    actor: list[int]  # actor rank i runs on actor[i] (the critic, when there is one, too)
    engines: list[list[int]]  # one GPU list per rollout engine
    reward_model: list[int]  # reward-model rank i runs on reward_model[i]; [] without one
    num_nodes: int  # the nodes these GPUs span


def gpu_layout(cfg: PPOConfig) -> GpuLayout:
    """The GPUs of a config whose placement fields `validate` accepted."""
    p = cfg.placement
    per_node, per_engine = p.num_gpus_per_node, cfg.engine.rollout_num_gpus_per_engine
    actor = [node * per_node + i for node in range(p.actor_num_nodes) for i in range(actor_gpus_per_node(cfg))]
    if p.colocate:
        engines = [actor[i:i + per_engine] for i in range(0, len(actor), per_engine)]
    else:
        engines = _engines_after(set(actor), num_engines(cfg), per_engine, per_node)
    used = actor + [g for engine in engines for g in engine]
    reward_model = []
    if cfg.reward.reward_model_path is not None:
        n = cfg.reward.reward_model_num_gpus
        reward_model = (sorted({g for engine in engines for g in engine}) if n == 0 else
                        [g for gpus in _engines_after(set(used), n, 1, per_node) for g in gpus])
        used += reward_model
    return GpuLayout(actor=actor, engines=engines, reward_model=reward_model, num_nodes=max(used) // per_node + 1)


def _engines_after(taken: set[int], count: int, per_engine: int, per_node: int) -> list[list[int]]:
    engines: list[list[int]] = []
    node = 0
    while len(engines) < count:
        free = [g for g in range(node * per_node, (node + 1) * per_node) if g not in taken]
        while len(free) >= per_engine and len(engines) < count:
            engines.append(free[:per_engine])
            free = free[per_engine:]
        node += 1
    return engines
