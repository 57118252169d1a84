"""The torch actor and critic trainer roles: the endpoints of roles.trainer.actor / critic
over an HF model in roles.trainer.torch.core.TrainCore (data parallel: every rank a replica)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from roles.trainer.actor import ActorRole
from roles.trainer.batching import MicroBatch
from roles.trainer.config import TrainerConfig
from roles.trainer.critic import CriticRole
from roles.trainer.objectives import Objective, policy_objective, value_objective
from roles.trainer.role import TrainerRole, checked_config
from roles.trainer.torch.core import TrainCore
from roles.trainer.torch.model import load_policy, load_value_model, policy_log_probs, values_forward
from runtime import endpoint


class _TorchRole(TrainerRole):
    _core: TrainCore

    def _build(self, config: TrainerConfig, *, role: str, load: Callable[[TrainerConfig], torch.nn.Module]) -> None:
        self.config = checked_config(config, TrainerConfig)
        self._join_group()
        torch.manual_seed(self.config.seed)
        self._core = TrainCore(self.config, load(self.config), self._device_memory(role))
        self._started()

    @endpoint
    def rank_layout(self) -> dict:
        """{"dp_rank", "dp_size", "is_output"}: every rank is a data-parallel replica whose
        results count."""
        return {"dp_rank": self._rank.rank, "dp_size": self._rank.world_size, "is_output": True}

    @property
    def model(self) -> torch.nn.Module:
        return self._core.model

    def _objective(self):
        return self._micro_loss


class ActorTrainer(_TorchRole, ActorRole):
    """The policy as an HF causal LM, float32 master weights (roles.trainer.torch.core)."""

    def __init__(self, config: TrainerConfig):
        self._build(config, role="actor",
                    load=lambda c: load_policy(c.hf_checkpoint, gradient_checkpointing=c.gradient_checkpointing))
        # The reference policy is the initial one; a CPU copy, swapped in for ref log-probs.
        self._ref_params = [p.detach().clone() for p in self.model.parameters()] if self.config.keep_ref else None

    def _parameters(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def _log_prob_fn(self):
        return self._log_probs

    def _log_probs(self, mb: MicroBatch) -> torch.Tensor:
        log_probs, _ = policy_log_probs(
            self.model, mb, temperature=self.config.temperature, dtype=self.config.torch_dtype, with_entropy=False
        )
        return log_probs

    def _micro_loss(self, mb: MicroBatch, counts: dict) -> Objective:
        cfg = self.config
        log_probs, entropy = policy_log_probs(
            self.model, mb, temperature=cfg.temperature, dtype=cfg.torch_dtype,
            with_entropy=cfg.entropy_coef != 0 or cfg.log_entropy, entropy_requires_grad=cfg.entropy_coef != 0,
        )
        return policy_objective(cfg, log_probs, entropy, mb, counts)

    def named_weights(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """ActorRole.named_weights: this backend's parameters are HF tensors already (`views`
        changes nothing)."""
        for name, param in self.model.named_parameters():
            yield name, param.detach().to(self.config.torch_dtype)


class CriticTrainer(_TorchRole, CriticRole):
    """The value model: the policy's backbone plus a scalar head (roles.trainer.torch.model.ValueModel)."""

    def __init__(self, config: TrainerConfig):
        self._build(config, role="critic", load=lambda c: load_value_model(
            c.hf_checkpoint, seed=c.seed, gradient_checkpointing=c.gradient_checkpointing))

    def _value_fn(self):
        return self._values

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        return values_forward(self.model, mb, dtype=self.config.torch_dtype)

    def _micro_loss(self, mb: MicroBatch, counts: dict) -> Objective:
        return value_objective(self.config, self._values(mb), mb, counts)
