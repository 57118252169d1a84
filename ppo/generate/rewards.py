"""The rollout's rewards once the engines are done: the reward model's scores, the weighted
sum with the rule rewards, and --custom-reward-post-process-path.

Reward model: its ranks (one per GPU, roles.reward.model_scorer) take their GPUs' leases
after the engines released them (on the engines' GPUs they onload their weights, and offload
them again before the actor takes over; on GPUs of their own they stay loaded), each scores
a token-balanced share of the rollout, and the driver sets `rm_score` on every sample and
the reward to `--rule-reward-coef` x the rule's + `--reward-model-coef` x the model's (with no
rule, the rule reward is 0). A rank that dies is waited for (it restarts alone) and the
whole rollout is scored again.

Post-process: as miles' `_post_process_rewards` (miles/ray/rollout/train_data_conversion.py),
the function sees the whole rollout at once, so it can normalise, rank or shape rewards across
samples and groups. Its contract here: it gets a list of sample dicts (`index`,
`group_index`, `prompt`, `response`, `label`, `metadata`, `reward`, `reward_status`, and
`rm_score` with a reward model: shallow copies) and returns one finite
float per sample, in order, which becomes the sample's reward (the one before stays as
`raw_reward`). miles' function also gets `args` and returns a (raw, processed) pair; ours
gets only the data, as --custom-rm-path's does.
"""

from __future__ import annotations

from roles.reward.custom import load_function
from roles.reward.values import reward_value
from runtime import ActorDied, gather

_SEEN = ("index", "group_index", "prompt", "response", "label", "metadata", "reward", "reward_status", "rm_score")


def finish(job, samples: list[dict], perf, post_process) -> dict[str, float]:
    """Score with the reward model (when there is one), combine, post-process (when a function
    is set); the rewards in `samples` are then final. Returns the reward model's metrics."""
    metrics = score_with_model(job, samples, perf) if job.reward_models else {}
    if post_process is not None:
        apply_post_process(post_process, samples, job.cfg.reward.custom_reward_post_process_path)
    return metrics


def score_with_model(job, samples: list[dict], perf) -> dict[str, float]:
    r = job.cfg.reward
    shares = token_shares([len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples], len(job.reward_models))
    with perf.phase("reward_model"):
        while True:
            try:
                with job.phases.during("reward_model"):
                    results = gather([rm.score.call([scored_text(samples[i]) for i in share])
                                      for rm, share in zip(job.reward_models, shares)])
                break
            except ActorDied as e:
                if e.role not in {rm.name for rm in job.reward_models}:
                    raise
                job.sup.wait_restarted(e.role, e.incarnation)
    for share, result in zip(shares, results):
        for i, score in zip(share, result["scores"]):
            samples[i]["rm_score"] = score
            samples[i]["reward"] = r.rule_reward_coef * samples[i]["reward"] + r.reward_model_coef * score
    seconds = max(result["seconds"] for result in results)
    tokens = sum(result["num_tokens"] for result in results)
    padded = sum(result["num_padded_tokens"] for result in results)
    return {"rollout/rm_score": sum(s["rm_score"] for s in samples) / len(samples),
            "perf/reward_model_tokens_per_s": tokens / seconds if seconds else 0.0,
            "perf/reward_model_padding": 1 - tokens / padded if padded else 0.0}


def scored_text(sample: dict) -> dict:
    """What a reward-model rank reads of a sample (roles.reward.model.messages_of)."""
    return {"prompt": sample["prompt"], "response": sample["response"], "messages": sample.get("messages")}


def token_shares(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Sample indices per rank, longest first to the rank with the fewest tokens so far; each
    share in ascending index order."""
    shares: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        rank = min(range(num_ranks), key=lambda k: (load[k], k))
        shares[rank].append(i)
        load[rank] += lengths[i]
    return [sorted(share) for share in shares]


def load_post_process(cfg):
    """The --custom-reward-post-process-path function, or None; ValueError if it cannot load."""
    path = cfg.reward.custom_reward_post_process_path
    return load_function(path, "custom_reward_post_process_path") if path else None


def apply_post_process(function, samples: list[dict], source: str) -> None:
    """Replace each sample's reward by `function`'s (the one before stays in `raw_reward`)."""
    rewards = function([{k: s.get(k) for k in _SEEN} for s in samples])
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
        got = f"{len(rewards)} values" if isinstance(rewards, (list, tuple)) else type(rewards).__name__
        raise ValueError(f"--custom-reward-post-process-path {source} must return one reward per sample "
                         f"({len(samples)}), got {got}")
    values = [reward_value(r, None, f"--custom-reward-post-process-path {source}") for r in rewards]
    for sample, value in zip(samples, values):
        sample["raw_reward"], sample["reward"] = sample["reward"], value
