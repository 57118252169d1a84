"""The scheduler's running batch: the requests of one slot geometry, waiting or in a slot, and
what each has sampled so far. It outlives a `stream` call (scheduler.py), so that requests that
arrive while others decode join them; a blocking `generate` is one batch from admission to the
last finish.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

from roles.rollout.sampling import GenerateRequest
from roles.rollout.torch_engine.kv_cache import Geometry
from roles.rollout.torch_engine.sampler import sampling_mode

MODES = ("greedy", "plain", "cut")  # sampler.sampling_mode's, each serving the ones before it


@dataclass(eq=False)
class Held:
    """One request in the engine, and its tokens so far."""

    request: GenerateRequest
    seed: int
    stops: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    @property
    def budget(self) -> int:
        return self.request.sampling.max_new_tokens

    def result(self) -> dict:
        return {"id": self.request.id, "token_ids": self.tokens, "logprobs": self.logprobs,
                "finish_reason": self.finish or "abort"}


class RunningBatch:
    def __init__(self, geometry: Geometry, sync_every: int):
        self.geometry = geometry
        self.sync_every = sync_every
        # longest budget first (scheduler.py, "admit"); ties in arrival order
        self.waiting: list[Held] = []
        self.slots: list[Held | None] = [None] * geometry.num_slots
        self.deferred: list[Held] = []  # too long for these slots: a batch of their own once this one drains
        self.mode = MODES[0]  # the decode mode: it serves every request the batch has held
        # slot_steps: slots decoded (batch size x steps); busy_steps: of those, tokens kept.
        # The *_queued pair counts only steps taken while requests were waiting: continuous
        # batching should keep that ratio near 1 (the tail, once nothing waits, cannot be full).
        self.stats = {"num_slots": geometry.num_slots, "slot_len": geometry.slot_len, "decode_steps": 0,
                      "slot_steps": 0, "busy_steps": 0, "slot_steps_queued": 0, "busy_steps_queued": 0,
                      "num_prefills": 0, "admitted_while_decoding": 0, "prefill_tokens": 0, "reused_tokens": 0}

    def fits(self, held: Held) -> bool:
        # the last sampled token is never fed back, but up to sync_every - 1 steps may run past it
        return len(held.request.prompt_ids) + held.budget + self.sync_every - 1 <= self.geometry.slot_len

    def add(self, held: Held) -> None:
        if not self.fits(held):
            self.deferred.append(held)
            return
        insort(self.waiting, held, key=lambda h: -h.budget)
        mode = sampling_mode([held.request.sampling])
        self.mode = max(self.mode, mode, key=MODES.index)

    def busy(self) -> list[int]:
        return [s for s, h in enumerate(self.slots) if h is not None]

    def held(self) -> list[Held]:
        return [*self.waiting, *(h for h in self.slots if h is not None), *self.deferred]
