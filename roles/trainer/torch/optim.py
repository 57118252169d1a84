"""The torch backend's optimizer: AdamW with Megatron's weight-decay grouping, grad clipping
(the lr schedule, both backends': roles.trainer.schedule)."""

from __future__ import annotations

import torch


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
