"""The `megatron` trainer backend: megatron-core GPTModel actor and critic.

Importing this package needs no megatron-core (CI imports it on Python 3.11 to test the
config, the weight mapper, the attention module and the packing); building a trainer
needs megatron-core (Python >= 3.12) and CUDA.

    shape      HF config -> ModelShape -> TransformerConfig kwargs
    mapper     HF <-> megatron state dicts (TP shards, PP stages, local/TE names)
    attention  core attention on SDPA / varlen, with context parallelism
    model      GPTModel (local spec + our attention, or TE's spec), critic value head
    packing    packed micro-batches
    logprobs   chunked log-probs and entropy from (vocab-parallel) output weights
    cp         context-parallel slicing of packed micro-batches, row reassembly
    offload    offload to page-locked host blocks, one per tag
    core       parallel state, DDP, optimizer, train loop
    trainer    the roles
"""

from roles.trainer.megatron.config import MegatronTrainerConfig
from roles.trainer.megatron.trainer import MegatronActorTrainer, MegatronCriticTrainer

__all__ = ["MegatronActorTrainer", "MegatronCriticTrainer", "MegatronTrainerConfig"]
