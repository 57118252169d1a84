"""MegatronTrainerConfig: the torch backend's TrainerConfig plus megatron's parallelism and
recompute flags (miles' names), validated before any process starts.

What the megatron trainer does not run yet is refused here, with the reason, rather than
at the first train step: TP, PP and CP > 1 (the weight mapper, model builder and the CP
attention module split them and are tested on the CPU, but the trainer's vocab-parallel
log-probs, pipeline schedule with packed micro-batches and CP token slicing are not built).
"""

from __future__ import annotations

from dataclasses import dataclass

from roles.trainer.config import TrainerConfig
from roles.trainer.megatron.shape import check_recompute

NOT_BUILT = {
    "tensor_model_parallel_size": "vocab-parallel log-probs and sequence-parallel packing in the trainer",
    "pipeline_model_parallel_size": "the pipeline schedule over packed micro-batches in the trainer",
    "context_parallel_size": "CP token slicing of packed micro-batches in the trainer (the attention module has CP)",
}


@dataclass(kw_only=True, frozen=True)
class MegatronTrainerConfig(TrainerConfig):
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    recompute_granularity: str | None = None  # None, "full" or "selective"
    recompute_method: str | None = None  # "uniform" or "block" (full recompute)
    recompute_num_layers: int | None = None
    use_distributed_optimizer: bool = True  # megatron's ZeRO-1 over data-parallel ranks
    logits_chunk_tokens: int = 2048  # response rows per fp32 logits chunk

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, missing in NOT_BUILT.items():
            size = getattr(self, name)
            if size < 1:
                raise ValueError(f"megatron trainer config: {name}={size}, expected >= 1")
            if size > 1:
                raise ValueError(
                    f"megatron trainer config: {name}={size} is not built yet ({missing}); use 1"
                )
        check_recompute(self.recompute_granularity, self.recompute_method, self.recompute_num_layers)
        if self.logits_chunk_tokens < 1:
            raise ValueError(f"megatron trainer config: logits_chunk_tokens={self.logits_chunk_tokens}, expected >= 1")
