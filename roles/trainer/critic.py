"""The critic trainer role's endpoints, both backends: token values and clipped value-loss
updates, over the hooks a backend's role defines (roles.trainer.torch, roles.trainer.megatron)."""

from __future__ import annotations

from roles.trainer.batching import CRITIC_TRAIN_KEYS
from roles.trainer.role import TrainerRole
from runtime import endpoint


class CriticRole(TrainerRole):
    """Value model of PPO: the policy's trunk plus a scalar head.

    A backend defines `_value_fn` and `_objective`. Starts offloaded: call
    `onload(["params"])` (and "optimizer" before training) first.
    """

    def _value_fn(self):
        """What the core's forward_only computes token values with."""
        raise NotImplementedError

    def _objective(self):
        """What the core's train trains: the value objective (roles.trainer.objectives)."""
        raise NotImplementedError

    @endpoint
    def compute_values(self, batch: dict) -> dict:
        """{"values": float32 [N, R]}: values[i, r] = V(state before response token r)."""
        return {"values": self._core.forward_only(batch, self._value_fn())}

    @endpoint
    def train(self, batch: dict, mini_batches: list[dict] | None = None) -> dict:
        """One pass of clipped value-loss updates; metrics averaged over optimizer steps:
        value_loss, value_clipfrac, grad_norm, lr (of the last step), skipped_nonfinite.
        `mini_batches`: a rank's share of each mini-batch (roles.trainer.group)."""
        return self._train(batch, CRITIC_TRAIN_KEYS, self._objective(), mini_batches)
