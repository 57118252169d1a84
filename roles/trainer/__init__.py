"""Actor and critic trainer roles: backend `torch` (HF models, data parallel) here, `megatron`
in roles.trainer.megatron (imported only when chosen). Each trainer role runs as a rank
group that the driver calls through one TrainerGroup (the rank contract: roles.trainer.group)."""

from __future__ import annotations

import importlib.util

from roles.trainer.actor import ActorTrainer
from roles.trainer.config import TrainerConfig
from roles.trainer.critic import CriticTrainer
from roles.trainer.group import TrainerGroup

__all__ = ["ActorTrainer", "BackendUnavailable", "CriticTrainer", "TrainerConfig", "TrainerGroup",
           "megatron_missing", "trainer_classes"]

TRAIN_BACKENDS = ("torch", "megatron")


class BackendUnavailable(RuntimeError):
    """The chosen training backend cannot run here (a package or the hardware it needs is missing)."""


def trainer_classes(backend: str) -> tuple[type, type]:
    """(actor class, critic class) of a training backend; the only place that branches on it."""
    if backend == "torch":
        return ActorTrainer, CriticTrainer
    if backend == "megatron":
        problem = megatron_missing()
        if problem:
            raise BackendUnavailable(f"--train-backend megatron cannot run here: {problem}. Please run on "
                                     "CUDA GPUs with megatron-core installed, or pass --train-backend torch")
        from roles.trainer.megatron import MegatronActorTrainer, MegatronCriticTrainer

        return MegatronActorTrainer, MegatronCriticTrainer
    raise ValueError(f"train_backend={backend!r}: allowed values are {', '.join(TRAIN_BACKENDS)}")


def megatron_missing() -> str | None:
    """Why the megatron backend cannot run in this environment, or None."""
    import torch

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return "megatron-core is not installed (it needs Python >= 3.12; .whl/ has the tested wheel)"
    if not torch.cuda.is_available():
        return "megatron-core needs CUDA and no CUDA GPU is visible"
    return None
