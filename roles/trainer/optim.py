"""AdamW with Megatron's weight-decay grouping, a warmup + decay lr schedule, grad clipping."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(kw_only=True, frozen=True)
class LRSchedule:
    """lr for optimizer step s (0-based): linear warmup to `lr`, then decay to `min_lr`.

    Warmup: lr * (s + 1) / warmup_steps for s < warmup_steps, so the first step already moves.
    Decay over the next decay_steps steps (constant: none), then min_lr; cosine follows
    min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2, t in [0, 1], as Megatron's scheduler.
    """

    lr: float
    min_lr: float
    schedule: str
    warmup_steps: int
    decay_steps: int | None

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        t = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.schedule == "linear":
            coeff = 1.0 - t
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * t))
        return self.min_lr + (self.lr - self.min_lr) * coeff


def build_adamw(
    model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW over trainable params; biases and norm scales (1-D) get no weight decay, as in Megatron.

    The optimizer state is created by torch on the first step, not here.
    """
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Total grad 2-norm before clipping; clips to max_norm when max_norm > 0.

    A non-finite norm is returned as is (the caller skips the step); the grads it
    leaves behind are then garbage and must be zeroed.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=False)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return float(norm)


def is_state_tensor(value: object) -> bool:
    """Optimizer state that lives with the params: moments, not AdamW's 0-d `step` counters,
    which torch keeps on the CPU (unless fused/capturable) and which are a few bytes."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state (0 before the first step: torch creates it lazily)."""
    return sum(
        v.numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if is_state_tensor(v)
    )
