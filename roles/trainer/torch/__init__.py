"""The `torch` trainer backend: HF models, float32 master weights, data parallel over gloo or
NCCL (every rank a replica). Runs anywhere torch does, the CPU included.

    model    HF policy and value model, log-probs and values of padded micro-batches
    optim    AdamW with Megatron's weight-decay grouping, grad clipping
    core     model, optimizer and memory of one trainer, its half of a train step
    trainer  the roles
"""

from roles.trainer.torch.trainer import ActorTrainer, CriticTrainer

__all__ = ["ActorTrainer", "CriticTrainer"]
