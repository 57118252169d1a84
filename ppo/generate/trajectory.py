"""A trajectory is a log of token ids: the prompt, then turns of model and environment tokens.

Model turns hold exactly the ids (and log-probs) the engine returned; environment turns (a
tool's answer rendered by the chat template) hold ids tokenized once, when they were added.
Nothing is ever decoded and encoded again, so what the trainer sees is what the engine saw.
The record is append-only: a rewritten history is a new trajectory.

    response_ids       every id after the prompt, in order
    loss_mask          1 on model tokens, 0 on environment tokens
    rollout_log_probs  the engine's log-prob on model tokens, 0.0 on environment tokens
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODEL, ENV = "model", "env"


@dataclass(frozen=True)
class Turn:
    source: str  # MODEL or ENV
    ids: tuple[int, ...]
    log_probs: tuple[float, ...] = ()  # MODEL only, one per id
    finish_reason: str | None = None  # MODEL only: the engine's "stop" or "length"


@dataclass
class Trajectory:
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)

    def add_model_turn(self, ids: list[int], log_probs: list[float], finish_reason: str) -> None:
        if len(ids) != len(log_probs):
            raise ValueError(f"a model turn needs one log-prob per token: {len(ids)} ids, {len(log_probs)} log-probs")
        self.turns.append(Turn(MODEL, tuple(ids), tuple(log_probs), finish_reason))

    def add_env_turn(self, ids: list[int]) -> None:
        self.turns.append(Turn(ENV, tuple(ids)))

    @property
    def ids(self) -> list[int]:
        """The whole context: what the engine reads before the next model turn."""
        return self.prompt_ids + self.response_ids

    @property
    def response_ids(self) -> list[int]:
        return [t for turn in self.turns for t in turn.ids]

    @property
    def loss_mask(self) -> list[int]:
        return [int(turn.source == MODEL) for turn in self.turns for _ in turn.ids]

    @property
    def rollout_log_probs(self) -> list[float]:
        return [lp for turn in self.turns for lp in (turn.log_probs if turn.source == MODEL else [0.0] * len(turn.ids))]

    @property
    def num_model_turns(self) -> int:
        return sum(turn.source == MODEL for turn in self.turns)

    @property
    def num_env_tokens(self) -> int:
        return sum(len(turn.ids) for turn in self.turns if turn.source == ENV)

    @property
    def finish_reason(self) -> str | None:
        """The last model turn's: "length" when the trajectory was cut off."""
        return next((turn.finish_reason for turn in reversed(self.turns) if turn.source == MODEL), None)

    def sample_fields(self) -> dict:
        """The fields of a rollout sample (ppo.generate.rollout) this trajectory fills."""
        return {"response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "rollout_log_probs": self.rollout_log_probs, "finish_reason": self.finish_reason,
                "num_turns": self.num_model_turns, "num_env_tokens": self.num_env_tokens}
