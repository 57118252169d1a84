"""Advantage estimators, selected by name: PPO (GAE), GRPO, REINFORCE++ and its baseline form.

Semantics follow verl's core_algos, with one deliberate difference: REINFORCE++
returns skip masked positions like GAE does, where verl resets the running return at
every masked token. The two agree when masks only pad the end of a response; with
tool output inside a response, verl would cut the outcome reward off from the turns
before the tool call.
"""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens
from algorithms.gae import check_discount, compute_gae
from algorithms.rewards import token_level_rewards
from algorithms.scan import masked_discounted_cumsum
from algorithms.whiten import masked_whiten

ADVANTAGE_ESTIMATORS = ("ppo", "grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def _outcome_scores(
    estimator: str, token_rewards: torch.Tensor | None, scores: torch.Tensor | None, valid: torch.Tensor
) -> torch.Tensor:
    """[B] scores: given directly, or the sum of token rewards over valid tokens (verl)."""
    if (token_rewards is None) == (scores is None):
        raise ValueError(f"{estimator} needs exactly one of scores [B] or token_rewards [B, T]")
    if scores is not None:
        if scores.shape != valid.shape[:1]:
            raise ValueError(f"scores must be [batch] = [{valid.shape[0]}], got shape {tuple(scores.shape)}")
        return scores.to(compute_dtype(scores))
    return masked(token_rewards, valid, compute_dtype(token_rewards)).sum(-1)


def _per_session(scores: torch.Tensor, sessions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([S] one outcome per session: the mean of its rows', and [B] each row's session ordinal),
    or (scores, None) without sessions. A session's rows must be consecutive."""
    if sessions is None:
        return scores, None
    if sessions.shape != scores.shape:
        raise ValueError(f"sessions must be [batch] = [{scores.shape[0]}], got shape {tuple(sessions.shape)}")
    _, row_session = torch.unique_consecutive(sessions, return_inverse=True)
    num_sessions = int(row_session[-1]) + 1 if row_session.numel() else 0
    if num_sessions != torch.unique(sessions).numel():
        raise ValueError("the rows of one session must be consecutive in the batch")
    sums = torch.zeros(num_sessions, dtype=scores.dtype).index_add_(0, row_session, scores)
    return sums / torch.bincount(row_session, minlength=num_sessions).to(scores.dtype), row_session


def _group_centered(scores: torch.Tensor, group_size: int | None, norm_by_std: bool, eps: float) -> torch.Tensor:
    """Scores minus their group's mean, optionally over (group std + eps); groups are
    consecutive runs of group_size rows (the samples of one prompt).

    Groups of one sample use mean 0 and std 1, as verl does, so the score passes through.
    """
    if group_size is None or group_size < 1 or scores.shape[0] % group_size != 0:
        raise ValueError(
            f"group_size must be a positive divisor of the batch size {scores.shape[0]}, got {group_size}"
        )
    if group_size == 1:
        return scores / (1.0 + eps) if norm_by_std else scores
    groups = scores.view(-1, group_size)
    centered = groups - groups.mean(-1, keepdim=True)
    if norm_by_std:
        centered = centered / (groups.std(-1, keepdim=True) + eps)  # unbiased std, as torch.std / verl
    return centered.reshape(-1)


def compute_advantages(
    estimator: str,
    *,
    mask: torch.Tensor,  # [B, T]
    token_rewards: torch.Tensor | None = None,  # [B, T], e.g. from token_level_rewards
    scores: torch.Tensor | None = None,  # [B] outcome scores
    values: torch.Tensor | None = None,  # [B, T] critic values, ppo only
    group_size: int | None = None,
    sessions: torch.Tensor | None = None,  # [B] int: rows with one id are one session's records
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, T] and 0 at masked positions.

    ppo                           GAE(gamma, lam) on token_rewards with the critic's values;
                                  returns are the critic's targets. Not whitened here:
                                  whitening is a training option (masked_whiten, or
                                  masked_moments + whiten_with_moments across ranks).
    grpo                          per-response score minus its group mean, divided by
                                  (group std + eps) when norm_by_std (Dr. GRPO: False);
                                  returns = advantages.
    gspo                          GRPO's advantages (GSPO changes the ratio, not the
                                  advantage: policy_loss(ratio_level="sequence")).
    reinforce_plus_plus           discounted reward-to-go (gamma) of token_rewards,
                                  whitened over the batch; returns = the reward-to-go.
    reinforce_plus_plus_baseline  score minus group mean, whitened over the batch;
                                  returns = advantages.

    Outcome estimators take scores, or token_rewards summed over valid tokens (so
    reward-level KL shaping counts); reinforce_plus_plus turns scores into token
    rewards on the last valid token. group_size: samples per prompt, consecutive rows.

    sessions: several rows may be one sampled response (an agent session whose chat
    template rewrote history gives a record per rewrite; docs/agents.md). The group
    estimators then take one outcome per session (the mean of its rows', equal to the
    session's shared reward when no reward-level KL is added), centre and scale it over
    group_size consecutive SESSIONS, and give each row its session's advantage: a group
    keeps its n members whatever the number of rows (miles' _normalize_rewards_by_rollout).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    check_discount(gamma, lam)
    if values is not None and estimator != "ppo":
        raise ValueError(f"values are the critic's and only the ppo estimator uses them, got them for {estimator}")
    valid = valid_tokens(mask, token_rewards=token_rewards, values=values)

    if estimator == "ppo":
        if token_rewards is None or values is None or scores is not None:
            raise ValueError("ppo needs token_rewards and values (build token rewards with token_level_rewards)")
        advantages, returns = compute_gae(token_rewards, values, valid, gamma=gamma, lam=lam)
        return torch.where(valid, advantages, 0.0), torch.where(valid, returns, 0.0)

    if estimator == "reinforce_plus_plus":
        if (token_rewards is None) == (scores is None):
            raise ValueError("reinforce_plus_plus needs exactly one of scores [B] or token_rewards [B, T]")
        if scores is not None:
            token_rewards = token_level_rewards(scores, valid)
        rewards = masked(token_rewards, valid, compute_dtype(token_rewards))
        returns = torch.where(valid, masked_discounted_cumsum(rewards, valid, gamma), 0.0)
        return masked_whiten(returns, valid), returns

    outcomes, row_session = _per_session(_outcome_scores(estimator, token_rewards, scores, valid), sessions)
    centered = _group_centered(
        outcomes,
        group_size,
        norm_by_std=norm_by_std if estimator in ("grpo", "gspo") else False,
        eps=eps,
    )
    if row_session is not None:
        centered = centered[row_session]
    advantages = torch.where(valid, centered.unsqueeze(-1), 0.0)
    if estimator == "reinforce_plus_plus_baseline":
        advantages = masked_whiten(advantages, valid)
    return advantages, advantages
