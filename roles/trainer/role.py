"""What the actor and critic trainers share as roles: memory endpoints and their lifecycle.

    starting -> offloaded <-> onloaded <-> training

A trainer is built offloaded (so it can start while another role holds the GPU lease),
is "onloaded" while any of its state is on the device, and "training" inside `train`.
Each move is published as a `state` event when the trainer runs as a spawned role.
"""

from __future__ import annotations

import time

from roles.trainer.core import TrainCore
from runtime import Actor, endpoint


class TrainerRole(Actor):
    lifecycle = {
        "starting": frozenset({"offloaded"}),
        "ready": frozenset({"offloaded"}),  # an in-process object starts "ready" (runtime.actor)
        "offloaded": frozenset({"onloaded"}),
        "onloaded": frozenset({"offloaded", "training"}),
        "training": frozenset({"onloaded"}),
    }
    _core: TrainCore

    def _started(self) -> None:
        """Call at the end of __init__: a new trainer holds nothing on the device."""
        self.set_state("offloaded")

    @endpoint
    def offload(self, tags: list[str]) -> dict:
        """Offload "params", "grads", "optimizer"; returns {"ledger", "bytes_in_use"}."""
        t0, before = time.time(), self._core.memory.bytes_in_use()
        report = self._core.offload(tags)
        self._settle()
        if tags:  # offload([]) is the memory report
            self.publish_span("offload", t0, tags=list(tags), bytes=before - report["bytes_in_use"],
                              bytes_in_use=report["bytes_in_use"])
        return report

    @endpoint
    def onload(self, tags: list[str]) -> dict:
        """Bring the tagged state onto the device (the caller holds the GPU lease)."""
        t0, before = time.time(), self._core.memory.bytes_in_use()
        report = self._core.onload(tags)
        self._settle()
        self.publish_span("onload", t0, tags=list(tags), bytes=report["bytes_in_use"] - before,
                          bytes_in_use=report["bytes_in_use"])
        return report

    @endpoint
    def save(self, path: str) -> dict:
        """Weights (safetensors, the model's parameter names), optimizer state, step and RNG
        state, written atomically."""
        return self._core.save(path, dict(self._core.model.named_parameters()))

    @endpoint
    def load(self, path: str) -> dict:
        """Weights, optimizer state, step and RNG state from a `save` directory."""
        return self._core.load(path, dict(self._core.model.named_parameters()))

    def _settle(self) -> None:
        self.set_state("offloaded" if {"params", "optimizer"} <= self._core.offloaded else "onloaded")

    def _train(self, batch: dict, required: tuple[str, ...], micro_loss) -> dict:
        self.set_state("training")
        try:
            return self._core.train(batch, required, micro_loss)
        finally:
            self.set_state("onloaded")
