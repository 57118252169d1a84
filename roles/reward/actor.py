"""The reward scorer role: ``Scorer`` served as an actor (a CPU process, ``restart="one_for_one"``)."""

from runtime import Actor, endpoint

from roles.reward.scorer import Scorer


class RewardScorer(Actor):
    """Scores samples by rule or custom function; see ``Scorer`` for the contract.

    Its worker processes die with it (death signal and closed pipes), so a restarted
    scorer starts clean.
    """

    def __init__(
        self,
        rm_type: str,
        custom_rm_path: str | None = None,
        timeout_s: float = 10.0,
        group_rm: bool = False,
        num_workers: int | None = None,
    ):
        self._scorer = Scorer(rm_type, custom_rm_path, timeout_s, group_rm, num_workers)

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
        """``{"num_scored", "num_errors", "num_timeouts", "num_worker_restarts"}`` since start."""
        return self._scorer.stats()

    def close(self) -> None:
        """Stop the worker processes (in-process use; a role process takes them down when it exits)."""
        self._scorer.close()
