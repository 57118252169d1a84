"""The reward roles' configs: ScorerConfig (RewardScorer, Scorer) and RewardModelConfig
(RewardModelScorer). The driver builds them from the run's config (ppo.setup.role_configs)."""

from __future__ import annotations

from dataclasses import dataclass

from roles.reward.rules import REWARD_RULES

REMOTE_RM = "remote_rm"  # miles' --rm-type of a reward service at --rm-url
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True, frozen=True)
class ScorerConfig:
    """Rule, custom-function or reward-service scoring (roles.reward.scorer.Scorer has the contract).

    rm_type: a rule in REWARD_RULES, or "remote_rm" (a service at rm_url); ignored when
      custom_rm_path ("path/to/file.py:function" or "module:function") is given.
    timeout_s: per sample (per attempt, for a service; per group call with group_rm).
    group_rm: the custom function gets each group's samples at once.
    num_workers: worker processes scoring in parallel; None: the CPU count, at most 4.
    rm_url, max_retries, max_concurrency: the reward service, how often a failed request is
      tried again, and how many requests are in flight at once.
    reward_key: a function or service answering with a dict: the key of the reward.
    """

    rm_type: str | None = None
    custom_rm_path: str | None = None
    timeout_s: float = 10.0
    group_rm: bool = False
    num_workers: int | None = None
    rm_url: str | None = None
    max_retries: int = 2
    max_concurrency: int = 32
    reward_key: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"scorer config: {name}={getattr(self, name)!r}, expected {allowed}")

        if self.custom_rm_path is None and self.rm_type not in (*REWARD_RULES, REMOTE_RM):
            raise bad("rm_type", f"a reward rule (one of {sorted(REWARD_RULES)}), {REMOTE_RM!r} (with rm_url), "
                                 "or set custom_rm_path")
        if not self.timeout_s > 0:
            raise bad("timeout_s", "> 0 (seconds per sample)")
        if self.num_workers is not None and self.num_workers < 1:
            raise bad("num_workers", ">= 1, or None (the CPU count, at most 4)")
        if self.uses_service:
            if self.rm_url is None:
                raise bad("rm_url", f"the reward service's URL with rm_type={REMOTE_RM!r}")
            if self.max_retries < 0:
                raise bad("max_retries", ">= 0")
            if self.max_concurrency < 1:
                raise bad("max_concurrency", ">= 1")

    @property
    def uses_service(self) -> bool:
        """Whether samples go to the reward service at rm_url (and not to worker processes)."""
        return self.custom_rm_path is None and self.rm_type == REMOTE_RM


@dataclass(kw_only=True, frozen=True)
class RewardModelConfig:
    """A reward model's rank (roles.reward.model_scorer.RewardModelScorer).

    path: an HF sequence-classification checkpoint with one label (roles.reward.model).
    dtype: bfloat16 on a GPU, float32 on fake GPUs and the CPU.
    max_tokens: padded tokens per micro-batch.
    """

    path: str
    dtype: str
    max_tokens: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"reward model config: dtype={self.dtype!r}, expected one of {DTYPES}")
        if self.max_tokens < 1:
            raise ValueError(f"reward model config: max_tokens={self.max_tokens!r}, expected >= 1")
