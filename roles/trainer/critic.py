"""The critic trainer role (torch backend): token values and clipped value-loss updates."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from roles.trainer.batching import CRITIC_TRAIN_KEYS, MicroBatch
from roles.trainer.config import TrainerConfig
from roles.trainer.core import TrainCore
from roles.trainer.model import ValueModel, load_value_model, values_forward
from roles.trainer.objectives import value_objective
from roles.trainer.role import TrainerRole
from runtime import endpoint


class CriticTrainer(TrainerRole):
    """Value model of PPO: the policy's backbone plus a scalar head (roles.trainer.model).

    Starts offloaded: call `onload(["params"])` (and "optimizer" before training) first.
    """

    def __init__(self, config: TrainerConfig | Mapping[str, Any]):
        self._join_group()
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig.from_dict(config)
        torch.manual_seed(self.config.seed)
        model = load_value_model(
            self.config.hf_checkpoint, seed=self.config.seed, gradient_checkpointing=self.config.gradient_checkpointing
        )
        self._core = TrainCore(self.config, model, self._device_memory("critic"))
        self._started()

    @property
    def model(self) -> ValueModel:
        return self._core.model

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        return values_forward(self.model, mb, dtype=self.config.torch_dtype)

    @endpoint
    def compute_values(self, batch: dict) -> dict:
        """{"values": float32 [N, R]}: values[i, r] = V(state before response token r)."""
        return {"values": self._core.forward_only(batch, self._values)}

    @endpoint
    def train(self, batch: dict, mini_batches: list[dict] | None = None) -> dict:
        """One pass of clipped value-loss updates; metrics averaged over optimizer steps:
        value_loss, value_clipfrac, grad_norm, lr (of the last step), skipped_nonfinite.
        `mini_batches`: a rank's share of each mini-batch (roles.trainer.group)."""
        return self._train(batch, CRITIC_TRAIN_KEYS, self._micro_loss, mini_batches)

    def _micro_loss(self, mb: MicroBatch, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return value_objective(self.config, self._values(mb), mb, counts)

