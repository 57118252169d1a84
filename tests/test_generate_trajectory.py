"""Multi-turn trajectories: the token record, its batch, and the math defined on model tokens only.

The references below are written from the definitions over the model's own tokens: drop the
environment tokens, run the textbook single-sequence recurrence in python floats, put the
results back at the model tokens' positions. The vectorised estimators (algorithms/) must
agree to float64 precision on interleaved trajectories.
"""

import random

import pytest
import torch

from algorithms import (aggregate, compute_advantages, kl_estimate, masked_whiten, policy_loss, token_level_rewards,
                        truncated_is, value_loss)
from ppo.generate.batch import build_batch
from ppo.generate.trajectory import Trajectory


def random_trajectory(rng: random.Random, max_turns: int = 4) -> Trajectory:
    """A prompt, then 1..max_turns model turns with an environment turn after all but (maybe) the last."""
    traj = Trajectory(prompt_ids=[rng.randrange(5, 40) for _ in range(rng.randint(1, 6))])
    turns = rng.randint(1, max_turns)
    for k in range(turns):
        n = rng.randint(1, 7)
        traj.add_model_turn([rng.randrange(5, 40) for _ in range(n)], [-rng.random() for _ in range(n)],
                            "stop")
        if k < turns - 1 or rng.random() < 0.3:  # sometimes the record ends with the environment
            traj.add_env_turn([rng.randrange(5, 40) for _ in range(rng.randint(1, 5))])
    return traj


def trajectory_batch(seed: int, num: int) -> tuple[list[Trajectory], dict]:
    rng = random.Random(seed)
    trajs = [random_trajectory(rng) for _ in range(num)]
    samples = [dict(t.sample_fields(), prompt_ids=t.prompt_ids, reward=rng.choice([0.0, 1.0, 0.5]))
               for t in trajs]
    return trajs, build_batch(samples, pad_id=0)


def model_positions(traj: Trajectory) -> list[int]:
    return [i for i, m in enumerate(traj.loss_mask) if m]


def test_trajectory_record_keeps_every_turn_in_order_with_masks():
    traj = Trajectory(prompt_ids=[1, 2])
    traj.add_model_turn([5, 6, 7], [-0.1, -0.2, -0.3], "stop")
    traj.add_env_turn([8, 9])
    traj.add_model_turn([10], [-0.5], "length")
    assert traj.ids == [1, 2, 5, 6, 7, 8, 9, 10]
    assert traj.response_ids == [5, 6, 7, 8, 9, 10]
    assert traj.loss_mask == [1, 1, 1, 0, 0, 1]
    assert traj.rollout_log_probs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.5]
    assert (traj.num_model_turns, traj.num_env_tokens, traj.finish_reason) == (2, 2, "length")
    with pytest.raises(ValueError, match="one log-prob per token"):
        traj.add_model_turn([1, 2], [-0.1], "stop")


def test_batch_masks_environment_tokens_and_zeroes_their_log_probs():
    trajs, batch = trajectory_batch(seed=0, num=6)
    for i, t in enumerate(trajs):
        m = len(t.response_ids)
        assert batch["loss_mask"][i, :m].tolist() == t.loss_mask
        assert batch["loss_mask"][i, m:].sum() == 0
        env = torch.tensor(t.loss_mask) == 0
        assert (batch["rollout_log_probs"][i, :m][env] == 0).all()
        assert batch["input_ids"][i, :len(t.ids)].tolist() == t.ids
    # a single-turn sample (no "loss_mask" key) still counts every response token
    plain = build_batch([{"prompt_ids": [1], "response_ids": [2, 3], "rollout_log_probs": [-1.0, -1.0],
                          "reward": 1.0}], pad_id=0)
    assert plain["loss_mask"].tolist() == [[1.0, 1.0]]


def reference_gae_on_model_tokens(traj, rewards_row, values_row, gamma, lam):
    """GAE over the model tokens alone: the next value is that of the next model token."""
    pos = model_positions(traj)
    adv = torch.zeros(len(rewards_row), dtype=torch.float64)
    running, next_value = 0.0, 0.0
    for p in reversed(pos):
        delta = float(rewards_row[p]) + gamma * next_value - float(values_row[p])
        running = delta + gamma * lam * running
        next_value = float(values_row[p])
        adv[p] = running
    return adv


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (1.0, 0.0)])
def test_gae_over_trajectory_skips_environment_tokens(gamma, lam):
    trajs, batch = trajectory_batch(seed=1, num=8)
    mask = batch["loss_mask"].double()
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    kl = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    # the outcome score lands on the last MODEL token, even when an environment turn ends the record
    rewards = token_level_rewards(batch["scores"].double(), mask, kl=kl, kl_coef=0.1)
    adv, returns = compute_advantages("ppo", mask=mask, token_rewards=rewards, values=values, gamma=gamma, lam=lam)
    for i, t in enumerate(trajs):
        assert rewards[i, model_positions(t)[-1]] == pytest.approx(float(batch["scores"][i]) - 0.1 * float(kl[i, model_positions(t)[-1]]))
        expected = reference_gae_on_model_tokens(t, rewards[i], values[i], gamma, lam)
        torch.testing.assert_close(adv[i], expected, rtol=1e-12, atol=1e-12)
        valid = mask[i] != 0
        torch.testing.assert_close(returns[i][valid], (expected + values[i])[valid], rtol=1e-12, atol=1e-12)
        assert (adv[i][~valid] == 0).all() and (returns[i][~valid] == 0).all()


def test_grpo_over_trajectories_gives_each_model_token_its_group_score():
    trajs, batch = trajectory_batch(seed=2, num=8)
    mask = batch["loss_mask"].double()
    scores = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 0.0, 0.25], dtype=torch.float64)
    adv, _ = compute_advantages("grpo", mask=mask, scores=scores, group_size=4)
    for i, t in enumerate(trajs):
        group = [float(s) for s in scores[i // 4 * 4:i // 4 * 4 + 4]]
        mean = sum(group) / 4
        std = (sum((s - mean) ** 2 for s in group) / 3) ** 0.5
        expected = torch.zeros(mask.shape[1], dtype=torch.float64)
        expected[model_positions(t)] = (float(scores[i]) - mean) / (std + 1e-6)
        torch.testing.assert_close(adv[i], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_over_trajectories_discounts_over_model_tokens_only(gamma):
    trajs, batch = trajectory_batch(seed=3, num=6)
    mask = batch["loss_mask"].double()
    scores = batch["scores"].double()
    adv, returns = compute_advantages("reinforce_plus_plus", mask=mask, scores=scores, gamma=gamma)
    expected = torch.zeros_like(mask)
    for i, t in enumerate(trajs):
        pos = model_positions(t)
        for k, p in enumerate(pos):  # reward-to-go: the score sits on the last model token
            expected[i, p] = gamma ** (len(pos) - 1 - k) * float(scores[i])
    torch.testing.assert_close(returns, expected, rtol=1e-12, atol=1e-12)
    flat = [float(expected[i, p]) for i, t in enumerate(trajs) for p in model_positions(t)]
    mean = sum(flat) / len(flat)
    std = (sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)) ** 0.5
    for i, t in enumerate(trajs):
        for p in model_positions(t):
            assert float(adv[i, p]) == pytest.approx((float(expected[i, p]) - mean) / (std ** 2 + 1e-8) ** 0.5,
                                                     rel=1e-10, abs=1e-10)
    torch.testing.assert_close(adv, masked_whiten(returns, mask))


def test_losses_kl_and_tis_never_read_environment_tokens():
    """Garbage at environment positions (where the trainer's log-probs and values are still
    computed) changes no loss, KL, entropy term or TIS weight."""
    _, batch = trajectory_batch(seed=4, num=6)
    mask = batch["loss_mask"]
    env = (mask == 0)

    def inputs(garbage: float):
        t = {k: -torch.rand(mask.shape, generator=torch.Generator().manual_seed(j)) for j, k in
             enumerate(("logp", "old", "ref", "roll", "values", "old_values", "returns", "adv", "entropy"))}
        return {k: torch.where(env, torch.full_like(v, garbage), v) for k, v in t.items()}

    results = []
    for garbage in (0.0, 1e4):
        x = inputs(garbage)
        pl, _ = policy_loss(x["logp"], x["old"], x["adv"], mask, agg="token-mean")
        vl, _ = value_loss(x["values"], x["old_values"], x["returns"], mask, agg="token-mean")
        kl = aggregate(kl_estimate(x["logp"], x["ref"], "low_var_kl"), mask, "token-mean")
        ent = aggregate(x["entropy"], mask, "token-mean")
        w, _ = truncated_is(train_log_probs=x["old"], rollout_log_probs=x["roll"], mask=mask)
        assert (w[env] == 0).all()
        results.append(torch.stack([pl, vl, kl, ent, w.sum()]))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
