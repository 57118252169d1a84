"""The phase plan: what each role takes onto its GPUs before a phase and gives up after it.

The one owner of GPU memory moves in a run. The loop, the engines' handoffs, the checkpoint
windows, trainer recovery and the reward model's turn ask for a phase by name; the plan says
which state (a memory tag) moves, and ppo.gpu.colocation makes each move through the lease
table, which checks it (exactly, on fake GPUs). What a move means for one tenant is its
`frees` tags (--offload-train, --offload-rollout and their levels): a tag it does not free
stays resident, so one table serves every placement mode - colocated (engines and trainers
take turns), disaggregated and side by side (no lease is shared, and nothing waits).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from ppo.gpu.colocation import Colocation, Tenant

@dataclass(frozen=True)
class Phase:
    who: str                        # "actor", "critic", "engines", "reward_models", or "trainer" (named at the call)
    take: tuple[str, ...] = ()      # brought onto the GPUs before the phase (its leases taken)
    give: tuple[str, ...] | None = None  # freed after it (its leases given up); None: kept for a later phase
    keep: str | None = None         # given up but kept resident (the actor's weights, for the weight sync)


PLAN: dict[str, Phase] = {
    # one iteration (ppo.loop.steps)
    "log_probs": Phase("actor", take=("params",), give=("params",)),
    "values": Phase("critic", take=("params",)),  # its weights stay for critic_train
    "critic_train": Phase("critic", take=("optimizer", "grads"), give=("params", "grads", "optimizer")),
    "actor_train": Phase("actor", take=("params", "optimizer", "grads"), give=("grads", "optimizer"), keep="params"),
    "reward_model": Phase("reward_models", take=("weights",), give=("weights",)),
    # the engines' handoffs (ppo.gpu.handoffs)
    "engines_release": Phase("engines", give=("kv_cache", "weights")),
    "engines_weights": Phase("engines", take=("weights",)),
    "engines_kv_cache": Phase("engines", take=("kv_cache",)),
    "engines_resume": Phase("engines", take=("weights", "kv_cache")),
    # sglang threw its weights away at the release: the actor holds its weights to push them again
    "actor_weights": Phase("actor", take=("params",), give=("params",), keep="params"),
    # a checkpoint's save or load: one trainer with its whole state on its GPUs
    "trainer_state": Phase("trainer", take=("params", "optimizer"), give=("params", "optimizer", "grads")),
}


class Phases:
    """The plan over one job's tenants."""

    def __init__(self, colocation: Colocation, tenants: dict[str, list[Tenant]]):
        self.colocation, self.tenants = colocation, tenants

    def enter(self, name: str, tenants: list[Tenant] | None = None) -> None:
        """Take what phase `name` needs (its tenants' leases, and its tags onto their GPUs)."""
        phase = PLAN[name]
        if phase.take:
            self.colocation.occupy(self._who(phase, tenants), list(phase.take))

    def leave(self, name: str, tenants: list[Tenant] | None = None, *, keep: str | None = None) -> None:
        """Give up what phase `name` frees after it; `keep` overrides the plan's (a trainer
        loaded inside a checkpoint window keeps its weights for the sync that follows)."""
        phase = PLAN[name]
        if phase.give is not None:
            self.colocation.vacate(self._who(phase, tenants), list(phase.give), keep=keep or phase.keep)

    @contextlib.contextmanager
    def during(self, name: str, tenants: list[Tenant] | None = None, *, keep: str | None = None) -> Iterator[None]:
        """Phase `name`'s memory for the body; nothing is given up when the body raises (a
        dead role's memory is the recovery's business)."""
        self.enter(name, tenants)
        yield
        self.leave(name, tenants, keep=keep)

    def _who(self, phase: Phase, tenants: list[Tenant] | None) -> list[Tenant]:
        if tenants is not None:
            return tenants
        if phase.who not in self.tenants:
            raise ValueError(f"phase plan: {phase.who!r} is named at the call (tenants=...)")
        return self.tenants[phase.who]

