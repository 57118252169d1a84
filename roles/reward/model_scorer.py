"""The reward-model scorer role: one process per GPU, a tenant of the memory handoff.

    starting -> offloaded <-> onloaded <-> scoring

It starts offloaded (its weights in CPU memory, so it needs no lease to start), and the
driver moves it as it moves the trainers (ppo.gpu.colocation): `onload(["weights"])` once it
holds its GPU's lease, `score`, then `offload(["weights"])` before it gives the lease up; on
a GPU of its own it is onloaded once and stays. Each memory endpoint returns the trainers'
report, {"ledger": {tag: bytes}, "bytes_in_use"}, which the lease table checks.
"""

from __future__ import annotations

import time

from roles.device import DeviceMemory, check_memory_tags, tenant_lifecycle
from roles.reward.config import RewardModelConfig
from roles.reward.model import RewardModel
from runtime import Actor, endpoint, wire

MEMORY_TAGS = ("weights",)
wire.register_config(RewardModelConfig)  # it travels to each rank's process as itself


class RewardModelScorer(Actor):
    lifecycle = tenant_lifecycle("scoring")

    def __init__(self, config: RewardModelConfig):
        ctx = self.context
        memory = DeviceMemory("reward-model" if ctx is None else ctx.name)
        for tag in ("weights", "activations"):  # a restarted rank: what its killed incarnation held is gone
            memory.account(tag, 0)
        self._model = RewardModel(config.path, dtype=config.dtype, max_tokens=config.max_tokens, memory=memory)
        self.set_state("offloaded")

    @endpoint
    def score(self, samples: list[dict]) -> dict:
        """{"scores": one float per sample, in order, "num_tokens", "num_padded_tokens", "seconds"};
        a sample is {"prompt", "response"} and, for a chat-format prompt, "messages"."""
        self.set_state("scoring", num_samples=len(samples))
        t0 = time.monotonic()
        try:
            scores, counts = self._model.score(samples)
        finally:
            self.set_state("onloaded")
        return {"scores": scores, **counts, "seconds": time.monotonic() - t0}

    @endpoint
    def onload(self, tags: list[str]) -> dict:
        """Bring the weights onto the GPU (the caller holds its lease)."""
        return self._move(tags, "device")

    @endpoint
    def offload(self, tags: list[str]) -> dict:
        """Move the weights to CPU memory; offload([]) is the memory report."""
        return self._move(tags, "cpu")

    def _move(self, tags: list[str], where: str) -> dict:
        check_memory_tags(tags, MEMORY_TAGS)
        t0, before, was_onloaded = time.time(), self._model.memory.bytes_in_use(), self._model.onloaded
        if tags and where == "device":
            self._model.onload()
        elif tags:
            self._model.offload()
        self.set_state("onloaded" if self._model.onloaded else "offloaded")
        report = {"ledger": self._model.memory.ledger(), "bytes_in_use": self._model.memory.bytes_in_use()}
        if self._model.onloaded != was_onloaded:  # a span for each real move, none for a resident one
            self.publish_span("onload" if where == "device" else "offload", t0, tags=list(tags),
                              bytes=abs(report["bytes_in_use"] - before))
        return report
