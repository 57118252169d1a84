"""Actor and critic trainer roles, two backends, each a subpackage with one entry point that
`trainer_classes` imports only when chosen: roles.trainer.torch (HF models, data parallel)
and roles.trainer.megatron (megatron-core). Each trainer role runs as a rank group that the
driver calls through one TrainerGroup (the rank contract: roles.trainer.group).

What both backends share sits here:
    config      TrainerConfig (megatron's extends it)
    role        TrainerRole: memory endpoints, lifecycle, checkpoints
    actor       the actor's endpoints over a backend's hooks
    critic      the critic's endpoints over a backend's hooks
    objectives  policy_objective and value_objective of one micro-batch
    steps       the train-step skeleton: mini-batch plan, non-finite skip, metrics
    schedule    the lr schedule
    batching    the batch schema, mini-batch split, micro-batch planning
    sharding    data-parallel shares and aggregation counts; group: the group handle
    distributed, rng, checkpoint   process groups, RNG state, checkpoint files
"""

from __future__ import annotations

import importlib.util

from roles.trainer.config import TrainerConfig
from roles.trainer.group import TrainerGroup

__all__ = ["BackendUnavailable", "TrainerConfig", "TrainerGroup", "megatron_missing", "trainer_classes"]

TRAIN_BACKENDS = ("torch", "megatron")


class BackendUnavailable(RuntimeError):
    """The chosen training backend cannot run here (a package or the hardware it needs is missing)."""


def trainer_classes(backend: str) -> tuple[type, type]:
    """(actor class, critic class) of a training backend; the only place that branches on it."""
    if backend == "torch":
        from roles.trainer.torch import ActorTrainer, CriticTrainer

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
