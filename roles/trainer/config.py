"""TrainerConfig: everything the actor and critic trainers are built from (the torch backend's
whole config; roles.trainer.megatron.config extends it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from algorithms import AGG_MODES, KL_KINDS, RATIO_LEVELS
from roles.trainer.schedule import LR_SCHEDULES, LRSchedule

DTYPES = ("float32", "bfloat16", "float16")
MEMORY_TAGS = ("params", "grads", "optimizer")  # what a trainer offloads and onloads, by name


@dataclass(kw_only=True, frozen=True)
class TrainerConfig:
    """One config for both trainers; the critic reads the model, optimizer and batching
    fields and value_clip, the actor everything but value_clip.

    Fields that ppo.config also holds have no default here: the driver passes each one,
    so the recipe's value is the only default (STYLE.md 4). Defaults are left only for
    what this backend alone knows, and for None meaning "off".
    """

    hf_checkpoint: str
    seed: int
    dtype: str = "bfloat16"  # compute dtype; master weights and optimizer state stay float32
    gradient_checkpointing: bool = False

    # optimizer and lr schedule (see roles.trainer.schedule and the backends' optimizers)
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int | None = None  # steps after warmup to reach min_lr; linear/cosine only
    weight_decay: float
    betas: tuple[float, float]
    adam_eps: float = 1e-8
    clip_grad: float  # 0 disables clipping (the norm is still reported)

    # batching: one optimizer step per global_batch_size samples; micro-batches by count or tokens
    global_batch_size: int
    micro_batch_size: int | None = None
    max_tokens_per_gpu: int | None = None

    # losses (algorithms)
    eps_clip: float
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    ratio_level: str = "token"  # "sequence": GSPO (algorithms.policy_loss)
    value_clip: float | None  # None: no clipping
    loss_agg_mode: str
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    entropy_coef: float
    log_entropy: bool = False  # report entropy_loss even when entropy_coef is 0
    temperature: float  # the rollout temperature; logits are divided by it
    keep_ref: bool  # keep the initial weights on CPU for ref log-probs (a KL term is on)

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"trainer config: {field}={getattr(self, field)!r}, expected {allowed}")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {DTYPES}")
        if self.lr_decay_style not in LR_SCHEDULES:
            raise bad("lr_decay_style", f"one of {LR_SCHEDULES}")
        if not self.lr > 0:
            raise bad("lr", "> 0")
        if not 0 <= self.min_lr <= self.lr:
            raise bad("min_lr", f"in [0, lr={self.lr}]")
        if self.lr_warmup_iters < 0:
            raise bad("lr_warmup_iters", ">= 0")
        if self.lr_decay_style != "constant" and (self.lr_decay_iters is None or self.lr_decay_iters < 1):
            raise bad("lr_decay_iters", f">= 1 with lr_decay_style={self.lr_decay_style!r}")
        if self.weight_decay < 0:
            raise bad("weight_decay", ">= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise bad("betas", "two floats in [0, 1)")
        if not self.adam_eps > 0:
            raise bad("adam_eps", "> 0")
        if self.clip_grad < 0:
            raise bad("clip_grad", ">= 0 (0 disables clipping)")
        if self.global_batch_size < 1:
            raise bad("global_batch_size", ">= 1")
        if (self.micro_batch_size is None) == (self.max_tokens_per_gpu is None):
            raise ValueError(
                "trainer config: set exactly one of micro_batch_size (fixed micro-batches) and "
                f"max_tokens_per_gpu (dynamic); got micro_batch_size={self.micro_batch_size}, "
                f"max_tokens_per_gpu={self.max_tokens_per_gpu}"
            )
        if self.micro_batch_size is not None and not 1 <= self.micro_batch_size <= self.global_batch_size:
            raise bad("micro_batch_size", f"in [1, global_batch_size={self.global_batch_size}]")
        if self.max_tokens_per_gpu is not None and self.max_tokens_per_gpu < 1:
            raise bad("max_tokens_per_gpu", ">= 1")
        if not 0 < self.eps_clip < 1:
            raise bad("eps_clip", "in (0, 1)")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            raise bad("eps_clip_high", "> 0 or None (same as eps_clip)")
        if self.eps_clip_c is not None and not self.eps_clip_c > 1:
            raise bad("eps_clip_c", "> 1 (dual-clip bound on the ratio) or None")
        if self.value_clip is not None and not self.value_clip > 0:
            raise bad("value_clip", "> 0 or None (no clipping)")
        if self.loss_agg_mode not in AGG_MODES:
            raise bad("loss_agg_mode", f"one of {AGG_MODES}")
        if self.ratio_level not in RATIO_LEVELS:
            raise bad("ratio_level", f"one of {RATIO_LEVELS}")
        if self.kl_loss_type not in KL_KINDS:
            raise bad("kl_loss_type", f"one of {KL_KINDS}")
        if self.kl_loss_coef < 0:
            raise bad("kl_loss_coef", ">= 0")
        if not self.temperature > 0:
            raise bad("temperature", "> 0")
        if self.use_kl_loss and not self.keep_ref:
            # keep_ref alone is fine too: the driver may use ref log-probs for a reward-level KL.
            raise ValueError(
                "trainer config: use_kl_loss=True needs ref log-probs, which this trainer computes "
                "from its reference copy; set keep_ref=True"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerConfig:
        """Build from plain values (JSON, a test's table); unknown or missing keys are an error."""
        fields = dataclasses.fields(cls)
        known = {f.name for f in fields}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"trainer config: unknown fields {unknown}; known: {sorted(known)}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in values]
        if missing:
            raise ValueError(f"trainer config: missing fields {missing} (they have no default here)")
        values = dict(values)
        if "betas" in values:
            values["betas"] = tuple(values["betas"])  # JSON has lists only
        return cls(**values)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def lr_schedule_fn(self) -> LRSchedule:
        return LRSchedule(
            lr=self.lr,
            min_lr=self.min_lr,
            schedule=self.lr_decay_style,
            warmup_steps=self.lr_warmup_iters,
            decay_steps=self.lr_decay_iters,
        )
