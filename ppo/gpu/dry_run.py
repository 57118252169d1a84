"""The memory plan of a config against a GPU's memory: the dry run's text, and the check a run
makes before any role starts."""

from __future__ import annotations

from ppo.config import PPOConfig
from ppo.gpu.memory_plan import GIB, MemoryPlan, plan_memory
from ppo.gpu.plan_report import format_memory_plan, refusal
from ppo.gpu.sizing import DEFAULT_PROMPT_LEN, FAKE_GPU_BYTES, gpu_capacity_bytes, plan_spec

NOMINAL_GPU_BYTES = 80 * GIB  # planned for when no GPU is here to read and none is named: an 80 GB card


def capacity_of(cfg: PPOConfig, gpu_memory_gb: float | None) -> tuple[int | None, str]:
    """(bytes of one GPU, where that came from): --gpu-memory-gb, the fake GPUs' size, or
    nvidia-smi; None when none of them says."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * GIB), "--gpu-memory-gb"
    if cfg.placement.fake_gpus:
        return FAKE_GPU_BYTES, "fake GPUs"
    found = gpu_capacity_bytes()
    return found, "nvidia-smi"


def memory_plan_text(cfg: PPOConfig, *, gpu_memory_gb: float | None) -> tuple[str, str | None]:
    """(the dry run's memory plan, the refusal line when it does not fit the GPU)."""
    spec = plan_spec(cfg)
    if spec is None:
        return (f"memory plan: none, --hf-checkpoint {cfg.checkpoint.hf_checkpoint} has no config.json here "
                "and is not named after an architecture ppo.make_model knows"), None
    prompt_len = cfg.rollout.rollout_max_prompt_len or DEFAULT_PROMPT_LEN
    capacity, source = capacity_of(cfg, gpu_memory_gb)
    checked = capacity is not None
    if not checked:
        capacity, source = NOMINAL_GPU_BYTES, "no GPU here to read, so not checked: --gpu-memory-gb N checks it"

    def replan(c: PPOConfig) -> MemoryPlan:
        return plan_memory(c, spec, capacity=capacity, prompt_len=prompt_len)

    plan = replan(cfg)
    prompts = ("--rollout-max-prompt-len" if cfg.rollout.rollout_max_prompt_len
               else f"a run plans with its data's longest; here {DEFAULT_PROMPT_LEN}")
    text = format_memory_plan(plan, source=source) + f"\nprompts up to {prompt_len} tokens ({prompts})"
    return text, refusal(cfg, plan, replan) if checked else None


def check_memory_plan(cfg: PPOConfig, *, prompt_len: int) -> MemoryPlan | None:
    """The run's memory plan on this machine's GPUs, with its data's longest prompt; ValueError
    with the one-line refusal when it does not fit. None without a plan (no spec, no GPU to read)."""
    spec = plan_spec(cfg)
    capacity, _ = capacity_of(cfg, None)
    if spec is None or capacity is None:
        return None

    def replan(c: PPOConfig) -> MemoryPlan:
        return plan_memory(c, spec, capacity=capacity, prompt_len=prompt_len)

    plan = replan(cfg)
    problem = refusal(cfg, plan, replan)
    if problem:
        raise ValueError(problem)
    return plan
