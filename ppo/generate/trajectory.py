"""A trajectory is a log of token ids: the prompt, then turns of model and environment tokens.

Model turns hold exactly the ids (and log-probs) the engine returned; environment turns (a
tool's answer rendered by the chat template) hold ids tokenized once, when they were added.
Nothing is ever decoded and encoded again, so what the trainer sees is what the engine saw.
The record is append-only: a rewritten history is a new trajectory.

    response_ids       every id after the prompt, in order
    loss_mask          1 on model tokens, 0 on environment tokens
    rollout_log_probs  the engine's log-prob on model tokens, 0.0 on environment tokens
    weight_versions    the weight version that sampled each model token; an environment token
                       carries the version of the model turn it answers (its loss mask is 0)

`state()` and `Trajectory.from_state` turn it into plain JSON and back (a partial rollout's
buffer keeps unfinished trajectories in checkpoints: ppo.generate.partial_tools).
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
    weight_version: int | None = None  # MODEL only: the weights that sampled it, where the engine said


@dataclass
class Trajectory:
    prompt_ids: list[int]
    turns: list[Turn] = field(default_factory=list)

    def add_model_turn(self, ids: list[int], log_probs: list[float], finish_reason: str,
                       weight_version: int | None = None) -> None:
        if len(ids) != len(log_probs):
            raise ValueError(f"a model turn needs one log-prob per token: {len(ids)} ids, {len(log_probs)} log-probs")
        self.turns.append(Turn(MODEL, tuple(ids), tuple(log_probs), finish_reason, weight_version))

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
    def weight_versions(self) -> list[int]:
        """Per response token (module docstring); ValueError if a model turn has no version."""
        out, version = [], None
        for turn in self.turns:
            if turn.source == MODEL:
                if turn.weight_version is None:
                    raise ValueError("a model turn without its weight version (add_model_turn(..., weight_version))")
                version = turn.weight_version
            out += [version if version is not None else 0] * len(turn.ids)  # env before any model turn: none yet
        return out

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

    def state(self) -> dict:
        """Plain JSON (lists, ints, floats, str): floats round-trip exactly."""
        return {"turns": [{"source": t.source, "ids": list(t.ids), "log_probs": list(t.log_probs),
                           "finish_reason": t.finish_reason, "weight_version": t.weight_version} for t in self.turns]}

    @classmethod
    def from_state(cls, prompt_ids: list[int], state: dict) -> Trajectory:
        return cls(list(prompt_ids), [Turn(t["source"], tuple(t["ids"]), tuple(t["log_probs"]), t["finish_reason"],
                                           t["weight_version"]) for t in state["turns"]])

    def sample_fields(self) -> dict:
        """The fields of a rollout sample (ppo.generate.rollout) this trajectory fills."""
        return {"response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "rollout_log_probs": self.rollout_log_probs, "finish_reason": self.finish_reason,
                "num_turns": self.num_model_turns, "num_env_tokens": self.num_env_tokens}
