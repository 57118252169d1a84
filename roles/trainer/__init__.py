"""Actor and critic trainer roles, backend `torch` (HF models); see roles.trainer.core."""

from roles.trainer.actor import ActorTrainer
from roles.trainer.config import TrainerConfig
from roles.trainer.critic import CriticTrainer

__all__ = ["ActorTrainer", "CriticTrainer", "TrainerConfig"]
