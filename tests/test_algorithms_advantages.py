"""compute_advantages (ppo, grpo, reinforce_plus_plus[_baseline]) and token_level_rewards,
against slow float64 references written from verl's definitions."""

import statistics

import pytest
import torch

from algorithms import ADVANTAGE_ESTIMATORS, compute_advantages, token_level_rewards

GROUP = 4


def random_rollout(seed, num_prompts=5, length=60):
    """Scores, token rewards, values and a mask with holes, ragged padding and an empty row."""
    gen = torch.Generator().manual_seed(seed)
    batch = num_prompts * GROUP
    noise = 0.1 * torch.randn(batch, generator=gen, dtype=torch.float64)
    scores = torch.randint(0, 2, (batch,), generator=gen).double() + noise
    scores[GROUP : 2 * GROUP] = 1.0  # a group where every sample scores the same
    token_rewards = 0.05 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths) & (torch.rand(batch, length, generator=gen) > 0.2)
    mask[5] = False
    return scores, token_rewards, values, mask.double()


def valid_positions(mask, b):
    return [t for t in range(mask.shape[1]) if mask[b, t]]


def reference_whiten(x, mask):
    picked = [float(x[b, t]) for b in range(mask.shape[0]) for t in valid_positions(mask, b)]
    mean, std = statistics.fmean(picked), statistics.variance(picked) ** 0.5
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in valid_positions(mask, b):
            out[b, t] = (float(x[b, t]) - mean) / (std**2 + 1e-8) ** 0.5
    return out


def reference_group_centered(scores, norm_by_std, eps=1e-6):
    out = []
    for start in range(0, len(scores), GROUP):
        group = [float(s) for s in scores[start : start + GROUP]]
        mean, std = statistics.fmean(group), statistics.stdev(group)
        out += [(s - mean) / (std + eps) if norm_by_std else s - mean for s in group]
    return out


def broadcast(per_row, mask):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in valid_positions(mask, b):
            out[b, t] = per_row[b]
    return out


def reference_token_level_rewards(scores, mask, kl, kl_coef):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        positions = valid_positions(mask, b)
        for t in positions:
            out[b, t] = -kl_coef * float(kl[b, t])
        if positions:
            out[b, positions[-1]] += float(scores[b])
    return out


def reference_reward_to_go(rewards, mask, gamma):
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        running = 0.0
        for t in reversed(valid_positions(mask, b)):
            running = float(rewards[b, t]) + gamma * running
            out[b, t] = running
    return out


def reference_gae(rewards, values, mask, gamma, lam):
    advantages = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        running, next_value = 0.0, 0.0
        for t in reversed(valid_positions(mask, b)):
            running = float(rewards[b, t]) + gamma * next_value - float(values[b, t]) + gamma * lam * running
            next_value = float(values[b, t])
            advantages[b, t] = running
    return advantages, torch.where(mask.bool(), advantages + values, 0.0)


def close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_token_level_rewards_matches_reference(kl_coef):
    scores, token_rewards, _, mask = random_rollout(seed=0)
    kl = token_rewards.masked_fill(mask == 0, float("nan"))  # junk where masked must not leak
    rewards = token_level_rewards(scores, mask, kl=kl, kl_coef=kl_coef)
    close(rewards, reference_token_level_rewards(scores, mask, token_rewards, kl_coef))
    assert torch.equal(rewards[5], torch.zeros(mask.shape[1]))  # empty row: no score, no NaN


def test_token_level_rewards_rejects_bad_input():
    scores, _, _, mask = random_rollout(seed=1)
    with pytest.raises(ValueError, match="kl_coef is 0.1 but kl is None"):
        token_level_rewards(scores, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="scores must be"):
        token_level_rewards(scores[:-1], mask)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_ppo_is_gae_with_zeros_at_masked_positions(gamma, lam):
    scores, token_rewards, values, mask = random_rollout(seed=2)
    rewards = token_level_rewards(scores, mask, kl=token_rewards, kl_coef=0.1)
    advantages, returns = compute_advantages(
        "ppo", mask=mask, token_rewards=rewards, values=values, gamma=gamma, lam=lam
    )
    expected_advantages, expected_returns = reference_gae(rewards, values, mask, gamma, lam)
    close(advantages, expected_advantages)
    close(returns, expected_returns)


@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus_baseline"])
def test_a_sessions_records_share_its_advantage_and_the_group_counts_sessions_not_rows(estimator):
    """An agent session that split leaves several rows (docs/agents.md): the group statistics are
    over its GROUP sessions, as if each were one row, and every record gets its session's."""
    scores, _, _, mask = random_rollout(seed=5)
    rows_per_session = [1 + (i % 3 == 1) + (i % 5 == 2) for i in range(len(scores))]
    row_session = torch.tensor([i for i, k in enumerate(rows_per_session) for _ in range(k)])
    row_mask = mask[row_session.clamp(max=4)]  # any mask: the outcome is given per row
    row_mask[:, 0] = 1.0
    one_row, _ = compute_advantages(estimator, mask=torch.ones(len(scores), 1, dtype=torch.float64), scores=scores,
                                    group_size=GROUP)
    advantages, _ = compute_advantages(estimator, mask=row_mask, scores=scores[row_session], group_size=GROUP,
                                       sessions=row_session * 7)  # any ids: rows with one id are one session
    if estimator == "grpo":  # the baseline form whitens over the batch's tokens, so only its sign is comparable
        close(advantages, broadcast(one_row[row_session, 0].tolist(), row_mask))
    else:
        assert torch.equal(advantages[:, 0] > 0, one_row[row_session, 0] > 0)
    with pytest.raises(ValueError, match="consecutive"):
        compute_advantages(estimator, mask=row_mask[:3], scores=scores[:3], group_size=3,
                           sessions=torch.tensor([0, 1, 0]))


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])  # GSPO changes the ratio, not the advantage
def test_grpo_matches_reference(norm_by_std, estimator):
    scores, _, _, mask = random_rollout(seed=3)
    advantages, returns = compute_advantages(
        estimator, mask=mask, scores=scores, group_size=GROUP, norm_by_std=norm_by_std
    )
    close(advantages, broadcast(reference_group_centered(scores, norm_by_std), mask))
    assert torch.equal(advantages, returns)
    assert torch.equal(advantages[GROUP : 2 * GROUP], torch.zeros(GROUP, mask.shape[1]))  # tied group: no signal


def test_grpo_from_token_rewards_sums_valid_tokens():
    scores, token_rewards, _, mask = random_rollout(seed=4)
    rewards = token_level_rewards(scores, mask, kl=token_rewards, kl_coef=0.2)
    sums = [sum(float(rewards[b, t]) for t in valid_positions(mask, b)) for b in range(mask.shape[0])]
    junk_outside_mask = rewards.masked_fill(mask == 0, 9.0)
    advantages, _ = compute_advantages("grpo", mask=mask, token_rewards=junk_outside_mask, group_size=GROUP)
    close(advantages, broadcast(reference_group_centered(sums, True), mask))


def test_grpo_singleton_groups_pass_scores_through_like_verl():
    scores, _, _, mask = random_rollout(seed=5)
    advantages, _ = compute_advantages("grpo", mask=mask, scores=scores, group_size=1)
    close(advantages, broadcast([float(s) / (1 + 1e-6) for s in scores], mask))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(gamma):
    scores, token_rewards, _, mask = random_rollout(seed=6)
    rewards = token_level_rewards(scores, mask, kl=token_rewards, kl_coef=0.1)
    advantages, returns = compute_advantages("reinforce_plus_plus", mask=mask, token_rewards=rewards, gamma=gamma)
    expected_returns = reference_reward_to_go(rewards, mask, gamma)
    close(returns, expected_returns)
    close(advantages, reference_whiten(expected_returns, mask))


def test_reinforce_plus_plus_from_scores_places_them_on_the_last_token():
    scores, _, _, mask = random_rollout(seed=7)
    from_scores = compute_advantages("reinforce_plus_plus", mask=mask, scores=scores, gamma=0.95)
    from_rewards = compute_advantages(
        "reinforce_plus_plus", mask=mask, token_rewards=token_level_rewards(scores, mask), gamma=0.95
    )
    close(from_scores[0], from_rewards[0])
    close(from_scores[1], from_rewards[1])


def test_reinforce_plus_plus_outcome_reaches_tokens_before_a_tool_call():
    # Turn 1, tool output (masked), turn 2. verl resets its running return at masked
    # tokens, which would leave turn 1 with return 0; here the hole is skipped.
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]])
    scores = torch.tensor([1.0, 0.0])
    _, returns = compute_advantages("reinforce_plus_plus", mask=mask, scores=scores, gamma=1.0)
    assert returns[0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_reinforce_plus_plus_agrees_with_verl_reset_when_masks_only_pad_the_end():
    scores, token_rewards, _, _ = random_rollout(seed=8)
    lengths = torch.randint(1, 61, (scores.shape[0], 1), generator=torch.Generator().manual_seed(8))
    mask = (torch.arange(60) < lengths).double()
    rewards = token_level_rewards(scores, mask, kl=token_rewards, kl_coef=0.1)
    verl_returns = torch.zeros_like(rewards)  # verl's loop: running return reset after each masked token
    running = torch.zeros(rewards.shape[0], dtype=torch.float64)
    for t in reversed(range(60)):
        running = rewards[:, t] + 0.9 * running
        verl_returns[:, t] = running
        running = running * mask[:, t]
    _, returns = compute_advantages("reinforce_plus_plus", mask=mask, token_rewards=rewards, gamma=0.9)
    close(returns, verl_returns * mask)


def test_reinforce_plus_plus_baseline_matches_reference():
    scores, _, _, mask = random_rollout(seed=9)
    advantages, returns = compute_advantages("reinforce_plus_plus_baseline", mask=mask, scores=scores, group_size=GROUP)
    centered = broadcast(reference_group_centered(scores, norm_by_std=False), mask)
    close(advantages, reference_whiten(centered, mask))
    assert torch.equal(advantages, returns)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
def test_every_estimator_is_finite_and_zero_on_masked_positions(estimator):
    scores, token_rewards, values, mask = random_rollout(seed=10)
    hidden = mask == 0
    inputs = {"token_rewards": token_rewards.masked_fill(hidden, float("nan"))}
    if estimator == "ppo":
        inputs["values"] = values.masked_fill(hidden, float("inf"))
    advantages, returns = compute_advantages(estimator, mask=mask, group_size=GROUP, gamma=0.99, lam=0.95, **inputs)
    for out in (advantages, returns):
        assert torch.isfinite(out).all()
        assert (out[hidden] == 0).all()


def test_estimator_input_errors_are_explicit():
    scores, token_rewards, values, mask = random_rollout(seed=11)
    allowed = r"'ppo', 'grpo', 'gspo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline'\).*'gae'"
    with pytest.raises(ValueError, match=allowed):
        compute_advantages("gae", mask=mask, token_rewards=token_rewards, values=values)
    with pytest.raises(ValueError, match="ppo needs token_rewards and values"):
        compute_advantages("ppo", mask=mask, token_rewards=token_rewards)
    with pytest.raises(ValueError, match="only the ppo estimator uses them"):
        compute_advantages("grpo", mask=mask, scores=scores, values=values, group_size=GROUP)
    with pytest.raises(ValueError, match="exactly one of scores"):
        compute_advantages("grpo", mask=mask, scores=scores, token_rewards=token_rewards, group_size=GROUP)
    with pytest.raises(ValueError, match="exactly one of scores"):
        compute_advantages("reinforce_plus_plus", mask=mask)
    with pytest.raises(ValueError, match="group_size must be a positive divisor of the batch size 20, got 3"):
        compute_advantages("grpo", mask=mask, scores=scores, group_size=3)
    with pytest.raises(ValueError, match="group_size"):
        compute_advantages("reinforce_plus_plus_baseline", mask=mask, scores=scores)
    with pytest.raises(ValueError, match="gamma must be in"):
        compute_advantages("reinforce_plus_plus", mask=mask, scores=scores, gamma=2.0)
