"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): sample prompts until enough groups pass a filter.

A group whose rewards are all equal (every answer right, or every one wrong) has zero GRPO
advantage: it costs a training pass and teaches nothing. With --dynamic-sampling-filter-path,
each step samples rounds of --over-sampling-batch-size prompts (miles' granularity) and keeps
the groups the filter passes, until --rollout-batch-size groups are kept; as in miles, the
kept groups are taken in sampling order and the surplus of the last round is dropped.

Two things miles does not do: the rounds are capped (--dynamic-sampling-max-extra-rounds after
the first), and a step that reaches the cap short of groups fills the batch up with dropped
groups, in sampling order, so the batch keeps its size (and its divisibility by the global
batch size); those are counted. Every round draws its prompts from the dataset in order and
seeds its requests with (rollout seed, step, round, index), so a run, and a run resumed from a
checkpoint (which stores the dataset position after the step's last round), is reproducible.

A filter takes one prompt's list of sample dicts (the rollout's: "reward", "response",
"label", ...) and returns a bool, or (bool, reason): dropped groups are counted per reason
as rollout/dynamic_filter/drop_<reason> (miles' metric).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ppo.generate.sessions import by_group, renumber
from roles.reward.custom import load_function

# (prompts, sampling round) -> their samples, scored, n per prompt in prompt order
Generate = Callable[[list[dict], int], list[dict]]
Filter = Callable[[list[dict]], "bool | tuple[bool, str | None]"]


def check_reward_nonzero_std(group: list[dict]) -> tuple[bool, str | None]:
    """Keep a group whose rewards differ (std > 1e-8, miles' built-in filter); the reason of a
    drop names the shared reward, e.g. zero_std_1.0 (all right) or zero_std_0.0 (all wrong)."""
    rewards = torch.tensor([float(s["reward"]) for s in group], dtype=torch.float64)
    keep = len(group) > 1 and bool(rewards.std() > 1e-8)
    return keep, None if keep else f"zero_std_{round(float(rewards[0]), 1)}"


@dataclass(frozen=True, kw_only=True)
class DynamicSampling:
    """What a step needs to sample a batch: its size in groups, the round size, the filter
    (None: one round of exactly the batch, no filter) and the cap on extra rounds."""

    num_groups: int
    n_samples_per_prompt: int
    over_sampling_batch_size: int
    keep: Filter | None = None
    filter_path: str | None = None
    max_extra_rounds: int = 0

    @classmethod
    def from_config(cls, cfg) -> DynamicSampling:
        """From a PPOConfig; loads the filter (a bad path fails here, before any step runs)."""
        from ppo.config import over_sampling_batch_size

        r = cfg.rollout
        path = r.dynamic_sampling_filter_path
        return cls(num_groups=r.rollout_batch_size, n_samples_per_prompt=r.n_samples_per_prompt,
                   over_sampling_batch_size=over_sampling_batch_size(cfg) if path else r.rollout_batch_size,
                   keep=load_function(path, "dynamic_sampling_filter_path") if path else None,
                   filter_path=path, max_extra_rounds=r.dynamic_sampling_max_extra_rounds)


def sample_batch(generate: Generate, next_prompts: Callable[[int], list[dict]], ds: DynamicSampling
                 ) -> tuple[list[dict], dict[str, float]]:
    """(samples of ds.num_groups groups in batch order, metrics). Samples are renumbered to
    their place in the batch ("index", "group_index") and carry their "sampling_round"."""
    if ds.keep is None:
        return generate(next_prompts(ds.num_groups), 0), {}
    kept, dropped, reasons = [], [], Counter()
    sampled_rewards: list[float] = []
    extra_rounds = 0
    for rnd in range(ds.max_extra_rounds + 1):
        prompts = next_prompts(ds.over_sampling_batch_size)
        samples = generate(prompts, rnd)
        sampled_rewards += [float(s["reward"]) for s in samples]
        for rows in by_group(samples):  # n sessions each (ppo.generate.sessions)
            group = [dict(s, sampling_round=rnd) for s in rows]
            keep, reason = verdict(ds, group)
            if keep:
                kept.append(group)
            else:
                dropped.append(group)
                reasons[reason or "filtered"] += 1
        extra_rounds = rnd
        if len(kept) >= ds.num_groups:
            break
    filled = max(0, ds.num_groups - len(kept))
    groups = kept[:ds.num_groups] + dropped[:filled]
    batch = renumber(groups)
    metrics = {
        "rollout/dynamic_sampling_kept_groups": len(kept),
        "rollout/dynamic_sampling_dropped_groups": len(dropped),
        "rollout/dynamic_sampling_extra_rounds": extra_rounds,
        "rollout/dynamic_sampling_filled_groups": filled,
        # the policy's reward over every sampled group; rollout/raw_reward is the kept batch's
        "rollout/sampled_raw_reward": sum(sampled_rewards) / len(sampled_rewards),
        **{f"rollout/dynamic_filter/drop_{reason}": count for reason, count in sorted(reasons.items())},
    }
    return batch, metrics


def verdict(ds: DynamicSampling, group: list[dict]) -> tuple[bool, str | None]:
    """The filter's (keep, reason) for one group; ValueError for a filter that returns something else."""
    out = ds.keep(group)
    keep, reason = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(keep, bool | torch.Tensor) or (isinstance(keep, torch.Tensor) and keep.numel() != 1):
        raise ValueError(f"dynamic_sampling_filter_path={ds.filter_path!r} returned {out!r}; a filter returns "
                         "a bool, or (bool, reason)")
    return bool(keep), reason
