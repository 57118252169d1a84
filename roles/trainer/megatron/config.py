"""MegatronTrainerConfig: the torch backend's TrainerConfig plus megatron's parallelism and
recompute flags (miles' names), validated before any process starts.

What the megatron trainer does not run is refused here, with the reason, rather than at
the first train step. Tensor, context and pipeline parallelism are built (vocab-parallel
log-probs, CP slicing of packed micro-batches, megatron's pipeline schedule with the weights
exported across stages; sequence parallelism is off); what has run where is in
docs/architecture.md, "Megatron model parallelism". Uneven pipeline stages are refused when
the model's shape is known (ModelSpec.check_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

from roles.trainer.config import MEMORY_TAGS, TrainerConfig
from roles.trainer.megatron.shape import check_recompute

TRANSFORMER_IMPLS = ("local", "transformer_engine")
PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


@dataclass(kw_only=True, frozen=True)
class MegatronTrainerConfig(TrainerConfig):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    recompute_granularity: str | None = None  # None, "full" or "selective"
    recompute_method: str | None = None  # "uniform" or "block" (full recompute)
    recompute_num_layers: int | None = None
    use_distributed_optimizer: bool = True  # megatron's ZeRO-1 over data-parallel ranks
    logits_chunk_tokens: int = 1024  # response rows per fp32 logits chunk (1.2 GiB of Qwen3 logits, their fp32 copies and grad 2.3 GiB more)
    # megatron's layers: "local" (local spec, roles.trainer.megatron.attention) or
    # "transformer_engine"; never chosen because transformer-engine happens to import
    transformer_impl: str = "local"
    # the memory tags the run offloads every iteration (ppo.config.derived.train_offload_tags):
    # the params' host block is then kept from construction on (roles.trainer.megatron.offload)
    offload_tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in PARALLEL_SIZES:
            size = getattr(self, name)
            if size < 1:
                raise ValueError(f"megatron trainer config: {name}={size}, expected >= 1")
        check_recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"megatron trainer config: transformer_impl={self.transformer_impl!r}, "
                             f"expected one of {TRANSFORMER_IMPLS}")
        object.__setattr__(self, "offload_tags", tuple(self.offload_tags))  # a list from plain values (from_dict)
        bad = [t for t in self.offload_tags if t not in MEMORY_TAGS]
        if bad:
            raise ValueError(f"megatron trainer config: offload_tags={self.offload_tags!r}, expected tags among "
                             f"{MEMORY_TAGS}")
        if self.logits_chunk_tokens < 1:
            raise ValueError(f"megatron trainer config: logits_chunk_tokens={self.logits_chunk_tokens}, expected >= 1")
