"""Which GPUs each role gets, from a validated `PPOConfig`.

The GPU ids come from ppo.config.layout (global ids, node by node; the rule the config's
cluster checks read too). The critic, when there is one, sits on exactly the actor's GPUs
with the actor's parallelism (as in miles). Rule reward scorers are CPU processes; a reward
model's ranks take their turn in the memory handoff on the engines' GPUs, or sit on GPUs of
their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo.config import PPOConfig, data_parallel_size, uses_critic
from ppo.config.layout import gpu_layout


@dataclass(frozen=True, kw_only=True)
class Placement:
    actor_gpus: list[int]  # actor rank i runs on actor_gpus[i]
    critic_gpus: list[int]  # [] without a critic, else the actor's
    engines: list[list[int]]  # one GPU list per rollout engine
    num_reward_workers: int  # CPU processes, no GPU
    reward_model_gpus: list[int]  # reward-model rank i runs on reward_model_gpus[i]; [] without one
    num_nodes: int
    num_gpus_per_node: int
    fake_gpus: bool
    train_backend: str  # "torch": data parallel ranks; "megatron": TP x PP x CP x DP ranks
    trainer_parallel: dict[str, int]  # each trainer's rank group: {"tp", "pp", "cp", "dp"}, one rank per GPU

    def node_of(self, gpu: int) -> int:
        return gpu // self.num_gpus_per_node

    def local_gpu(self, gpu: int) -> int:
        """The id of `gpu` within its node, as CUDA_VISIBLE_DEVICES there spells it."""
        return gpu % self.num_gpus_per_node


def plan_placement(cfg: PPOConfig) -> Placement:
    """The GPU plan of a config that `validate` accepted."""
    gpus = gpu_layout(cfg)
    return Placement(
        actor_gpus=gpus.actor,
        critic_gpus=list(gpus.actor) if uses_critic(cfg) else [],
        engines=gpus.engines,
        num_reward_workers=cfg.reward.num_reward_workers,
        reward_model_gpus=gpus.reward_model,
        num_nodes=gpus.num_nodes,
        num_gpus_per_node=cfg.placement.num_gpus_per_node,
        fake_gpus=cfg.placement.fake_gpus,
        train_backend=cfg.training.train_backend,
        trainer_parallel=trainer_parallel(cfg),
    )


def trainer_parallel(cfg: PPOConfig) -> dict[str, int]:
    """The rank layout of the actor's (and the critic's) group: tp x pp x cp x dp = its GPUs."""
    q = cfg.parallelism
    return {"tp": q.tensor_model_parallel_size, "pp": q.pipeline_model_parallel_size,
            "cp": q.context_parallel_size, "dp": data_parallel_size(cfg)}


def format_ranks(plan: Placement, gpus: list[int]) -> str:
    """'2 ranks: dp 2' (torch) or '8 ranks: tp 2 x pp 1 x cp 2 x dp 2' (megatron)."""
    par = plan.trainer_parallel
    dims = ["dp"] if plan.train_backend == "torch" else ["tp", "pp", "cp", "dp"]
    return f"{len(gpus)} ranks: " + " x ".join(f"{d} {par[d]}" for d in dims)


def format_placement(plan: Placement) -> str:
    """A role | GPUs | nodes table for the dry run."""
    rows = [("actor", plan.actor_gpus, format_ranks(plan, plan.actor_gpus))]
    if plan.critic_gpus:
        rows.append(("critic", plan.critic_gpus, format_ranks(plan, plan.critic_gpus)))
    rows += [(f"engine {i}", gpus, "") for i, gpus in enumerate(plan.engines)]
    if plan.reward_model_gpus:
        rows.append(("reward model", plan.reward_model_gpus, f"{len(plan.reward_model_gpus)} ranks"))
    kind = "fake GPUs" if plan.fake_gpus else "GPUs"
    lines = [f"{'role':<14}{kind:<24}{'nodes':<8}processes"]
    for role, gpus, ranks in rows:
        nodes = sorted({plan.node_of(g) for g in gpus})
        lines.append(f"{role:<14}{_span(gpus):<24}{_span(nodes):<8}{ranks or '1'}".rstrip())
    lines.append(f"{'reward':<14}{f'cpu x {plan.num_reward_workers}':<24}-")
    lines.append(f"{plan.num_nodes} node(s) x {plan.num_gpus_per_node} {kind}")
    return "\n".join(lines)


def _span(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for g in ids:
        if runs and g == runs[-1][-1] + 1:
            runs[-1].append(g)
        else:
            runs.append([g])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def format_nodes(plan: Placement, master: str | None = None, this_node: int | None = None) -> str:
    """One line per node: its roles with the node's own GPU ids (CUDA_VISIBLE_DEVICES there).
    Node 0 runs the driver and, at `master`, the rendezvous store; `this_node` is marked."""
    roles: dict[int, list[str]] = {n: [] for n in range(plan.num_nodes)}
    named = [("actor", plan.actor_gpus), ("critic", plan.critic_gpus), ("reward model", plan.reward_model_gpus)]
    named += [(f"engine {i}", gpus) for i, gpus in enumerate(plan.engines)]
    for role, gpus in named:
        for node in sorted({plan.node_of(g) for g in gpus}):
            local = [plan.local_gpu(g) for g in gpus if plan.node_of(g) == node]
            roles[node].append(f"{role} [{_span(local)}]")
    lines = []
    for node, placed in roles.items():
        head = f"node {node}" + (" (this one)" if node == this_node else "")
        extra = ["driver", f"{plan.num_reward_workers} reward worker(s)"] if node == 0 else []
        if node == 0 and master:
            extra.append(f"rendezvous store at {master}")
        lines.append(f"{head}: " + ", ".join(extra + placed or ["idle"]))
    return "\n".join(lines)
