"""The lr schedule of both trainer backends: warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
