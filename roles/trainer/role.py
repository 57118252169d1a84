"""What the actor and critic trainers share as roles: memory endpoints and their lifecycle.

    starting -> offloaded <-> onloaded <-> training

A trainer is built offloaded (so it can start while another role holds the GPU lease),
is "onloaded" while any of its state is on the device, and "training" inside `train`.
Each move is published as a `state` event when the trainer runs as a spawned role.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from roles.compute_check import check_in_run
from roles.device import DeviceMemory, tenant_lifecycle
from roles.trainer.config import TrainerConfig
from roles.trainer.distributed import Rank, init_from_env
from runtime import Actor, endpoint, wire

wire.register_config(TrainerConfig)  # it travels to each rank's process as itself


def checked_config(config: TrainerConfig, cls: type[TrainerConfig]) -> TrainerConfig:
    """`config` when it is a `cls`; a trainer takes its backend's typed config, never a dict."""
    if not isinstance(config, cls):
        raise TypeError(f"this trainer takes a {cls.__name__} ({cls.__module__}), got {type(config).__name__}; "
                        f"build one with {cls.__name__}(...) or {cls.__name__}.from_dict(values)")
    return config


class TrainerCore(Protocol):
    """What a backend's core gives its roles (roles.trainer.torch.core.TrainCore,
    roles.trainer.megatron.core.MegatronCore)."""

    memory: DeviceMemory
    step: int

    @property
    def offloaded(self) -> set[str]: ...
    def offload(self, tags: list[str]) -> dict: ...
    def onload(self, tags: list[str]) -> dict: ...
    def require_onloaded(self, *tags: str) -> None: ...
    def forward_only(self, batch: dict, fn) -> torch.Tensor: ...
    def train(self, batch: dict, required: tuple[str, ...], objective, mini_batches: list[dict] | None) -> dict: ...
    def save(self, path: str) -> dict: ...
    def load(self, path: str) -> dict: ...


class TrainerRole(Actor):
    lifecycle = tenant_lifecycle("training")
    _core: TrainerCore
    _rank: Rank = Rank(0, 1)

    def _join_group(self) -> None:
        """Call first in __init__: a rank of a rank group joins its process group (the rank
        contract, roles.trainer.group); an in-process or single trainer is rank 0 of 1."""
        self._rank = init_from_env()

    def _device_memory(self, default: str) -> DeviceMemory:
        """The memory ledger under the role's name: a rank group's lease on each GPU is the role's."""
        ctx = self.context
        return DeviceMemory(default if ctx is None else ctx.group or ctx.name)

    def _started(self, **fields) -> None:
        """Call at the end of __init__: a new trainer holds nothing on the device. `fields` go
        into the state event (how the backend was built)."""
        self.set_state("offloaded", **fields)

    @endpoint
    def offload(self, tags: list[str]) -> dict:
        """Offload "params", "grads", "optimizer"; returns {"ledger", "bytes_in_use"}."""
        t0, before = time.time(), self._core.memory.bytes_in_use()
        report = self._core.offload(tags)
        self._settle()
        if tags:  # offload([]) is the memory report
            self.publish_span("offload", t0, tags=list(tags), bytes=before - report["bytes_in_use"],
                              **_move_fields(report))
        return report

    @endpoint
    def onload(self, tags: list[str]) -> dict:
        """Bring the tagged state onto the device (the caller holds the GPU lease)."""
        t0, before = time.time(), self._core.memory.bytes_in_use()
        report = self._core.onload(tags)
        self._settle()
        self.publish_span("onload", t0, tags=list(tags), bytes=report["bytes_in_use"] - before,
                          **_move_fields(report))
        return report

    @endpoint
    def save(self, path: str) -> dict:
        """Weights, optimizer state, step and RNG state, written atomically (the core's save says
        which ranks write what). Every backend saves and loads with its weights and optimizer
        on the device (megatron can do no other: ppo.gpu.handoffs), so the driver's windows for
        it are exercised by every run."""
        self._core.require_onloaded("params", "optimizer")
        return self._core.save(path)

    @endpoint
    def load(self, path: str) -> dict:
        """Weights, optimizer state, step and RNG state from a `save` directory, into a
        trainer with its weights and optimizer on the device, as `save`."""
        self._core.require_onloaded("params", "optimizer")
        return self._core.load(path)

    def _settle(self) -> None:
        self.set_state("offloaded" if {"params", "optimizer"} <= self._core.offloaded else "onloaded")

    def _train(self, batch: dict, required: tuple[str, ...], objective, mini_batches: list[dict] | None) -> dict:
        """The core's train pass (roles.trainer.steps) in the "training" state; `objective` is
        what the backend's core trains (torch: a micro-batch loss; megatron: the role itself)."""
        if mini_batches is None and self._rank.distributed:
            raise ValueError(f"rank {self._rank.rank} of {self._rank.world_size}: train needs mini_batches, its "
                             "share of each mini-batch (roles.trainer.group.TrainerGroup passes them)")
        self.set_state("training")
        try:
            check_in_run(self._core.memory.holder)  # side by side under MPS: still computing right
            return self._core.train(batch, required, objective, mini_batches)
        finally:
            self.set_state("onloaded")


def _move_fields(report: dict) -> dict:
    """Span fields of a memory move beyond the device bytes freed or taken: the bytes actually
    copied (a backend that reports its moves; grads are freed and zeroed, never copied) and
    the allocations no tag covers, when the backend names them."""
    fields = {"bytes_in_use": report["bytes_in_use"]}
    if "moves" in report:
        fields["copied"] = sum(m["bytes"] for m in report["moves"].values())
    if report.get("untracked"):
        fields["untracked"] = report["untracked"]
    return fields
