"""What the megatron core sets up and adjusts around megatron-core: the parallel groups a
rank joins, the HF state it starts from, and three departures from megatron's defaults (torch's
fused AdamW; its rotary cache treated as cache; torch.compile in process). Needs megatron-core
and CUDA at call time."""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist

from roles.trainer.megatron.config import MegatronTrainerConfig


def init_parallel(config: MegatronTrainerConfig) -> None:
    """Join the rank group (or make a world of one) and set up megatron's parallel groups."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from roles.trainer.distributed import init_from_env

    torch.cuda.set_device(0)  # a rank sees only its own GPU (CUDA_VISIBLE_DEVICES)
    init_from_env()
    if not dist.is_initialized():  # in-process trainer (tests, bench): a world of one
        # an in-memory store: nothing to listen on, so no port to race for
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
        # ours to close: NCCL warns at exit of a group never destroyed (it may leak resources)
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=config.tensor_model_parallel_size,
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            context_parallel_size=config.context_parallel_size,
        )
        model_parallel_cuda_manual_seed(config.seed)


def compile_in_process() -> None:
    """megatron's fused SwiGLU is torch.compile'd: compile in this process, not in inductor's
    pool of worker processes, which outlive the compiling process as its children (on the
    H200 the GPU tests' orphan check caught 16 of them). The rollout engine does the same."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


def load_hf_state(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint directory's safetensors files, on the CPU."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        state.update(load_file(f))
    return state


def hf_tensor_names(path: str) -> list[str]:
    """The tensor names of an HF checkpoint directory, read from the files' headers only."""
    from safetensors import safe_open

    names: list[str] = []
    for f in _safetensors_files(path):
        with safe_open(f, framework="pt") as st:
            names += list(st.keys())
    return names


def _safetensors_files(path: str) -> list[str]:
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files (the megatron trainer loads HF safetensors)")
    return [os.path.join(path, f) for f in files]


def use_fused_adam(optimizers: list) -> None:
    """Without apex or transformer-engine megatron steps torch's AdamW in its foreach form: on
    the H200 that took 99.7 ms and 15 GiB of temporaries over Qwen3-4B, the fused kernel 41.7
    ms and none (bench.trainer; docs/journal/, "Trainer backends"). Adam's state appears at the first step,
    after this switch, so its step counters are made on the device as the fused kernel needs;
    `load` keeps these groups, and torch moves a loaded state's counters to the device."""
    for opt in optimizers:
        inner = opt.optimizer
        if type(inner).__module__.startswith("torch.optim"):  # not apex's or transformer-engine's
            for group in inner.param_groups:
                group["fused"], group["foreach"] = True, False


def drop_rotary_cache() -> None:
    """megatron caches a rotary table per packed max_seqlen on the GPU (lru_cache, up to 32
    float32 tables of length x head_dim; transformer-engine's spec), the local spec's core
    attention what it derives per batch (roles.trainer.megatron.batch_memo): cache, not state.
    Dropped before the memory is reported, or every lease handoff would count it as memory
    the trainer forgot to offload."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from roles.trainer.megatron import batch_memo

    batch_memo.drop()

    clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if clear is not None:
        clear()
