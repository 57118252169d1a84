"""The rollout's rewards once every sample is scored: --custom-reward-post-process-path.

As miles' `_post_process_rewards` (miles/ray/rollout/train_data_conversion.py), the function
sees the whole rollout at once, so it can normalise, rank or shape rewards across samples
and groups. Its contract here: it gets a list of sample dicts (`index`, `group_index`,
`prompt`, `response`, `label`, `metadata`, `reward`, `reward_status`: copies, changing them
changes nothing) and returns one finite float per sample, in order, which becomes the
sample's reward (the score was kept as `raw_reward`). miles' function also gets `args` and
returns a (raw, processed) pair; ours gets only the data, as --custom-rm-path's does.
"""

from __future__ import annotations

from roles.reward.custom import load_function
from roles.reward.values import reward_value

_SEEN = ("index", "group_index", "prompt", "response", "label", "metadata", "reward", "reward_status")


def load_post_process(cfg):
    """The --custom-reward-post-process-path function, or None; ValueError if it cannot load."""
    path = cfg.reward.custom_reward_post_process_path
    return load_function(path, "custom_reward_post_process_path") if path else None


def post_process(function, samples: list[dict], source: str) -> None:
    """Replace each sample's reward by `function`'s (the score stays in `raw_reward`)."""
    rewards = function([{k: s.get(k) for k in _SEEN} for s in samples])
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise ValueError(f"--custom-reward-post-process-path {source} must return one reward per sample "
                         f"({len(samples)}), got {got}")
    values = [reward_value(r, None, f"--custom-reward-post-process-path {source}") for r in rewards]
    for sample, value in zip(samples, values):
        sample["raw_reward"], sample["reward"] = sample["reward"], value
