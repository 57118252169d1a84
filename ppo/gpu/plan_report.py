"""The memory plan said to a user: the dry run's table, and the one line that refuses a plan
that does not fit, naming the flags that would make it fit."""

from __future__ import annotations

from typing import Callable

from ppo.config import PPOConfig, override
from ppo.gpu.memory_plan import GIB, KINDS, MemoryPlan

_SHORT = {"weights": "w", "grads": "g", "optimizer": "o", "kv_cache": "kv", "activations": "a",
          "sync_buffers": "s", "slack": "f",
          "cuda_context": "c"}

# What a user can move, cheapest first: the engines free their KV cache (their graphs are
# captured again), then their weights too; the trainers move their weights as well as their
# optimizer; full recomputation; smaller micro-batches (dynamic batching: only ever smaller than
# the run's); a growing share of the optimizer kept and stepped on the CPU (megatron). Each fix
# keeps the ones before it.
FIXES: tuple[dict, ...] = (
    {"offload_rollout": True, "offload_rollout_level": "kv_cache"},
    {"offload_rollout": True, "offload_rollout_level": "all"},
    {"offload_train": True, "offload_train_level": "all"},
    {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    {"max_tokens_per_gpu": 8192},
    {"max_tokens_per_gpu": 4096},
    *({"optimizer_cpu_offload": True, "optimizer_offload_fraction": f} for f in (0.25, 0.5, 0.75, 1.0)),
)


def format_memory_plan(plan: MemoryPlan, *, source: str) -> str:
    """One row per GPU and phase: the peak and what each role holds, in GiB; `source` says
    where the GPU's memory came from."""
    roles = sorted({r for p in plan.phases for r in p.held}, key=_role_order)
    legend = ", ".join(f"{s} {k.replace('_', ' ')}" for k, s in _SHORT.items())
    lines = [f"memory plan, GiB per GPU of {plan.capacity / GIB:.1f} GiB ({source}); {legend}",
             f"{'gpu':<4}{'phase':<14}{'peak':>7}  " + "".join(f"{r:<37} " for r in roles).rstrip()]
    for p in plan.phases:
        cells = []
        for r in roles:
            kinds = p.held.get(r, {})
            cells.append(" ".join(f"{_SHORT[k]} {_gib(kinds[k])}" for k in KINDS if kinds.get(k)) or "-")
        over = "  OVER" if p.peak > plan.capacity else ""
        lines.append(f"{p.gpu:<4}{p.phase:<14}{p.peak / GIB:>7.2f}  " + "".join(f"{c:<37} " for c in cells).rstrip()
                     + over)
    worst = plan.worst()
    verdict = "fits" if plan.fits() else "does NOT fit"
    lines.append(f"peak {worst.peak / GIB:.2f} GiB in phase {worst.phase} on GPU {worst.gpu}: {verdict}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def refusal(cfg: PPOConfig, plan: MemoryPlan, replan: Callable[[PPOConfig], MemoryPlan]) -> str | None:
    """None when the plan fits; else one line: the phase, its peak, the GPU's memory and the
    flags that would make it fit (the first of FIXES, with the ones before it, whose plan fits)."""
    if plan.fits():
        return None
    worst = plan.worst()
    line = (f"the memory plan does not fit: phase {worst.phase} needs {worst.peak / GIB:.1f} GiB on GPU {worst.gpu}, "
            f"which has {plan.capacity / GIB:.1f} GiB")
    fix = fitting_flags(cfg, replan)
    if fix is None:
        return line + "; moving every state it can move is not enough: use more GPUs or a smaller model"
    return line + f"; it fits with {fix} (see it with --dry-run)"


def fitting_flags(cfg: PPOConfig, replan: Callable[[PPOConfig], MemoryPlan]) -> str | None:
    """The command-line flags of the cheapest fit: FIXES applied one after the other."""
    fields: dict = {}
    for fix in FIXES:
        tokens = fix.get("max_tokens_per_gpu")
        if tokens is not None and not (cfg.training.use_dynamic_batch_size and tokens < cfg.training.max_tokens_per_gpu):
            continue
        fields.update(fix)
        changed = {k: v for k, v in fields.items() if _value(cfg, k) != v}
        if changed and replan(override(cfg, **changed)).fits():
            return " ".join(_flag(k, v) for k, v in changed.items())
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f}" if nbytes >= GIB // 100 else "<.01"


def _value(cfg: PPOConfig, name: str):
    """The field's value in effect (an unset offload switch follows the placement)."""
    from ppo import config as C
    from ppo.config.serialize import FIELDS

    effective = {"offload_train": C.offload_train, "offload_rollout": C.offload_rollout}
    return effective[name](cfg) if name in effective else getattr(getattr(cfg, FIELDS[name].group), name)


def _flag(name: str, value) -> str:
    flag = "--" + name.replace("_", "-")
    if value is True:
        return flag
    if value is False:
        return "--no-" + name.replace("_", "-")
    return f"{flag} {value}"


def _role_order(role: str) -> tuple[int, str]:
    return ({"actor": 0, "critic": 1}.get(role, 2), role)
