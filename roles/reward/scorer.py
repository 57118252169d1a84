"""Scores rollout samples with a rule, a custom function or a remote reward service, never letting
one sample take the scorer down.

A sample whose reward function raises, returns a non-float, kills its worker or runs past
``timeout_s`` (a service: fails or runs past it on every attempt) gets reward 0.0 with status
``"error"``/``"timeout"`` and a message; the counts are in ``stats()``. Only mistakes of the
caller (a malformed sample list) or a configuration that cannot start raise.
"""

import os
import sys
from collections import Counter

from roles.reward.config import ScorerConfig
from roles.reward.custom import load_reward_function
from roles.reward.pool import JobResult, WorkerPool
from roles.reward.remote import RemoteReward
from roles.reward.worker import JobConfig

_MAX_DEFAULT_WORKERS = 4


class Scorer:
    """Reward scoring for batches of sample dicts; ``RewardScorer`` serves it as an actor.

    ``config.rm_type`` names a rule in ``REWARD_RULES`` unless ``custom_rm_path`` is given, in
    which case the custom function scores every sample (as ``--custom-rm-path`` in
    miles). ``rm_type="remote_rm"`` posts each sample to the service at ``rm_url``
    (``remote.RemoteReward``: ``timeout_s`` per attempt, ``max_retries``, at most
    ``max_concurrency`` requests at once). A custom function or a service may answer with a
    dict, from which ``reward_key`` picks the reward (``values.reward_value``). With
    ``group_rm`` the custom function gets each group's samples at once (samples sharing
    ``group_index``, in the order given) and the timeout covers the whole group call; a
    built-in rule still scores samples one by one. ``num_workers`` worker processes score in
    parallel (default: CPU count, at most 4).
    """

    def __init__(self, config: ScorerConfig):
        if not isinstance(config, ScorerConfig):
            raise TypeError(f"Scorer takes a ScorerConfig (roles.reward.config), got {type(config).__name__}")
        if config.custom_rm_path is not None:
            load_reward_function(config.custom_rm_path)  # a wrong path fails here, with its own message
        self._group_rm = config.group_rm and config.custom_rm_path is not None
        self._pool: WorkerPool | RemoteReward
        if config.uses_service:
            self._pool = RemoteReward(config.rm_url, timeout_s=config.timeout_s, max_retries=config.max_retries,
                                      max_concurrency=config.max_concurrency, reward_key=config.reward_key)
        else:
            job = JobConfig(rm_type=config.rm_type, custom_rm_path=config.custom_rm_path, group_rm=self._group_rm,
                            reward_key=config.reward_key, sys_path=tuple(sys.path))
            num_workers = config.num_workers or min(_MAX_DEFAULT_WORKERS, os.cpu_count() or 1)
            self._pool = WorkerPool(job, num_workers=num_workers, timeout_s=config.timeout_s)
        self._counts: Counter[str] = Counter()

    def score(self, samples: list[dict]) -> list[dict]:
        """One ``{"index", "reward", "status", "error"}`` per sample, in the order given."""
        samples = [_checked_sample(s, self._group_rm) for s in samples]
        if self._group_rm:
            groups: dict[object, list[int]] = {}
            for position, sample in enumerate(samples):
                groups.setdefault(sample["group_index"], []).append(position)
            members = list(groups.values())
            group_results = self._pool.run([[samples[p] for p in group] for group in members])
            results: list[JobResult | None] = [None] * len(samples)
            for group, result in zip(members, group_results, strict=True):
                for k, position in enumerate(group):
                    value = result.value[k] if result.status == "ok" else None
                    results[position] = JobResult(status=result.status, value=value, error=result.error)
        else:
            results = self._pool.run(samples)
        self._counts.update(r.status for r in results)
        return [
            {
                "index": sample["index"],
                "reward": result.value if result.status == "ok" else 0.0,
                "status": result.status,
                "error": result.error,
            }
            for sample, result in zip(samples, results, strict=True)
        ]

    def stats(self) -> dict:
        """Counts since start; ``num_scored`` counts every sample returned, whatever its status.
        Rules and functions add ``num_worker_restarts``, a service ``num_retries``."""
        return {
            "num_scored": sum(self._counts.values()),
            "num_errors": self._counts["error"],
            "num_timeouts": self._counts["timeout"],
            **self._pool.stats(),
        }

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _checked_sample(sample: dict, group_rm: bool) -> dict:
    if not isinstance(sample, dict):
        raise ValueError(f"a sample must be a dict, got {type(sample).__name__}")
    for key, kind in (("index", int), ("response", str)):
        if not isinstance(sample.get(key), kind):
            got = sample.get(key)
            raise ValueError(f"sample {sample.get('index')!r}: {key!r} must be {kind.__name__}, got {got!r}")
    if group_rm and "group_index" not in sample:
        raise ValueError(f"sample {sample['index']}: group_rm needs 'group_index' in every sample")
    metadata = sample.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"sample {sample['index']}: 'metadata' must be a dict, got {type(metadata).__name__}")
    return {
        "index": sample["index"],
        "group_index": sample.get("group_index", sample["index"]),
        "prompt": sample.get("prompt", ""),
        "response": sample["response"],
        "label": sample.get("label"),
        "metadata": metadata,
    }
