"""The reward scorer role: ``Scorer`` served as an actor (a CPU process, ``restart="one_for_one"``)."""

from roles.reward.config import ScorerConfig
from roles.reward.scorer import Scorer
from runtime import Actor, endpoint, wire

wire.register_config(ScorerConfig)  # it travels to the scorer's process as itself


class RewardScorer(Actor):
    """Scores samples by rule, custom function or reward service; see ``Scorer`` for the contract.

    Its worker processes die with it (death signal and closed pipes), so a restarted
    scorer starts clean.
    """

    def __init__(self, config: ScorerConfig):
        self._scorer = Scorer(config)

    lifecycle = {"starting": frozenset({"ready"}), "ready": frozenset({"scoring"}),
                 "scoring": frozenset({"ready"})}

    @endpoint
    def score(self, samples: list[dict]) -> list[dict]:
        """Per sample ``{"index", "reward", "status": "ok"|"error"|"timeout", "error"}``."""
        self.set_state("scoring", num_samples=len(samples))
        try:
            return self._scorer.score(samples)
        finally:
            self.set_state("ready")

    @endpoint
    def stats(self) -> dict:
        """``Scorer.stats``: ``{"num_scored", "num_errors", "num_timeouts", ...}`` since start."""
        return self._scorer.stats()

    def close(self) -> None:
        """Stop the worker processes (in-process use; a role process takes them down when it exits)."""
        self._scorer.close()
