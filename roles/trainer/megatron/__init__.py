"""The `megatron` trainer backend: megatron-core GPTModel actor and critic.

Importing this package needs no megatron-core (CI imports it on Python 3.11 to test the
config, the weight mapper, the attention module and the packing); building a trainer
needs megatron-core (Python >= 3.12) and CUDA.

    shape      HF config -> ModelSpec -> TransformerConfig kwargs
    mapper     HF <-> megatron state dicts (TP shards, PP stages, local/TE names)
    attention  core attention on SDPA / varlen, with context parallelism
    rope       RoPE for that attention, with no host sync (local spec)
    batch_memo what every layer derives from one packed micro-batch, computed once
    model      GPTModel (local spec + our attention, or TE's spec), critic value head
    packing    packed micro-batches
    logprobs   chunked log-probs and entropy from (vocab-parallel) output weights
    cp         context-parallel slicing of packed micro-batches, row reassembly
    offload    offload to page-locked host blocks, one per tag
    env        parallel groups, the HF start state, departures from megatron's defaults
    export     HF tensors of every pipeline stage, gathered to stage 0
    core       DDP, optimizer, forward, the backend's half of a train step (roles.trainer.steps)
    trainer    the roles
"""

from roles.trainer.megatron.config import MegatronTrainerConfig
from roles.trainer.megatron.trainer import MegatronActorTrainer, MegatronCriticTrainer

__all__ = ["MegatronActorTrainer", "MegatronCriticTrainer", "MegatronTrainerConfig"]
