"""compute_gae and the masked scan against a slow float64 reference and closed forms."""

import pytest
import torch

from algorithms import compute_gae, masked_discounted_cumsum
from algorithms.scan import chunk_length


def reference_gae(rewards, values, mask, gamma, lam):
    """Obvious masked GAE: python floats, one token at a time, masked tokens skipped."""
    batch, length = mask.shape
    advantages = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        running, next_value = 0.0, 0.0
        for t in reversed(range(length)):
            if mask[b, t]:
                delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
                running = delta + gamma * lam * running
                next_value = float(values[b, t])
            advantages[b, t] = running
    return advantages


def random_batch(seed, batch, length, dtype=torch.float64, hole_p=0.2):
    """Rewards, values and a mask with interior holes, ragged padding and one empty row."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(batch, length, generator=gen, dtype=dtype)
    values = torch.randn(batch, length, generator=gen, dtype=dtype)
    lengths = torch.randint(0, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths) & (torch.rand(batch, length, generator=gen) >= hole_p)
    mask[0] = False
    return rewards, values, mask.to(dtype)


# Decays gamma * lam from 1 (plain cumsum) through chunked scans of 512 down to 5 positions, and 0.
DISCOUNTS = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.5), (0.5, 0.3), (0.2, 0.05), (1.0, 0.0), (0.0, 1.0)]


@pytest.mark.parametrize("gamma,lam", DISCOUNTS)
def test_gae_matches_reference_on_random_masks(gamma, lam):
    rewards, values, mask = random_batch(seed=1, batch=6, length=1100)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    expected = reference_gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == torch.float64
    torch.testing.assert_close(advantages, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, expected + values, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.3)])
def test_gae_float32_stays_close_to_float64_reference(gamma, lam):
    rewards, values, mask = random_batch(seed=2, batch=8, length=3000, dtype=torch.float32)
    advantages, _ = compute_gae(rewards, values, mask, gamma, lam)
    assert advantages.dtype == torch.float32
    expected = reference_gae(rewards.double(), values.double(), mask, gamma, lam)
    torch.testing.assert_close(advantages.double(), expected, rtol=1e-5, atol=1e-4)


def test_lambda_zero_gives_td_errors():
    rewards, values, _ = random_batch(seed=3, batch=3, length=7)
    mask = torch.ones(3, 7, dtype=torch.float64)
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.9, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(advantages, rewards + 0.9 * next_values - values)


def test_lambda_one_gamma_one_gives_reward_to_go_minus_value():
    rewards, values, _ = random_batch(seed=4, batch=3, length=9)
    mask = torch.ones(3, 9, dtype=torch.float64)
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(advantages, reward_to_go - values)
    torch.testing.assert_close(returns, reward_to_go)


@pytest.mark.parametrize("gamma", [1.0, 0.97, 0.6, 0.0])
def test_lambda_one_returns_do_not_depend_on_values(gamma):
    rewards, values, mask = random_batch(seed=5, batch=5, length=300)
    other_values = values + torch.randn(values.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    _, returns = compute_gae(rewards, values, mask, gamma, lam=1.0)
    _, other_returns = compute_gae(rewards, other_values, mask, gamma, lam=1.0)
    valid = mask.bool()
    torch.testing.assert_close(returns[valid], other_returns[valid], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("gamma,lam", DISCOUNTS)
def test_masked_rewards_and_values_change_nothing_at_valid_positions(gamma, lam):
    rewards, values, mask = random_batch(seed=6, batch=5, length=700)
    hidden = ~mask.bool()
    junk_rewards = rewards.masked_fill(hidden, float("nan"))
    junk_values = values.masked_fill(hidden, float("inf"))
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    junk_advantages, junk_returns = compute_gae(junk_rewards, junk_values, mask, gamma, lam)
    assert torch.equal(advantages, junk_advantages)  # masked positions carry the next valid advantage
    assert torch.equal(returns[~hidden], junk_returns[~hidden])


def test_masked_position_carries_next_valid_advantage():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 9.0, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    advantages, _ = compute_gae(rewards, values, mask, gamma=0.5, lam=1.0)
    a3 = 1.0 - 0.4  # last valid token bootstraps with 0
    a1 = (0.0 + 0.5 * 0.4 - 0.2) + 0.5 * a3  # next valid value is V[3]: the hole is skipped
    a0 = (0.0 + 0.5 * 0.2 - 0.1) + 0.5 * a1
    torch.testing.assert_close(advantages, torch.tensor([[a0, a1, a3, a3, 0.0]]))


def test_all_masked_rows_give_zero_advantages_and_no_nan():
    rewards, values, _ = random_batch(seed=7, batch=3, length=600, dtype=torch.float32)
    mask = torch.zeros(3, 600)
    for gamma, lam in DISCOUNTS:
        advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
        assert torch.equal(advantages, torch.zeros(3, 600))
        assert torch.equal(returns, values)


def test_gae_is_differentiable_gradcheck():
    rewards, values, mask = random_batch(seed=8, batch=3, length=12)
    rewards.requires_grad_(True)
    values.requires_grad_(True)
    for gamma, lam in [(0.9, 0.8), (1.0, 1.0), (0.7, 0.0)]:
        assert torch.autograd.gradcheck(lambda r, v: compute_gae(r, v, mask, gamma, lam), (rewards, values))


def test_bfloat16_inputs_compute_in_float32():
    rewards, values, mask = random_batch(seed=9, batch=2, length=50, dtype=torch.float32)
    advantages, returns = compute_gae(rewards.bfloat16(), values.bfloat16(), mask.bool(), 0.99, 0.95)
    assert advantages.dtype == returns.dtype == torch.float32
    expected = reference_gae(rewards.bfloat16().double(), values.bfloat16().double(), mask, 0.99, 0.95)
    torch.testing.assert_close(advantages.double(), expected, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_value_error():
    rewards, values, mask = random_batch(seed=10, batch=2, length=5)
    with pytest.raises(ValueError, match="gamma"):
        compute_gae(rewards, values, mask, gamma=1.5)
    with pytest.raises(ValueError, match="lam"):
        compute_gae(rewards, values, mask, lam=-0.1)
    with pytest.raises(ValueError, match="values has shape"):
        compute_gae(rewards, values[:, :4], mask)


@pytest.mark.parametrize("decay", [1.0, 0.999, 0.9, 0.3, 1e-3, 1e-30, 0.0])
def test_scan_matches_sequential_recurrence(decay):
    x, _, mask = random_batch(seed=11, batch=4, length=1500)
    valid = mask.bool()
    x = x.masked_fill(~valid, 0.0)
    expected = torch.zeros_like(x)
    for b in range(4):
        running = 0.0
        for t in reversed(range(1500)):
            if valid[b, t]:
                running = float(x[b, t]) + decay * running
            expected[b, t] = running
    torch.testing.assert_close(masked_discounted_cumsum(x, valid, decay), expected, rtol=1e-10, atol=1e-12)


def test_chunks_keep_powers_in_float32_range():
    for decay in [0.999999, 0.95, 0.5, 1e-3, 1e-30]:
        chunk = chunk_length(decay)
        assert 1 <= chunk <= 512
        smallest = torch.tensor(decay, dtype=torch.float64) ** chunk
        largest = torch.tensor(decay, dtype=torch.float64) ** -(chunk - 1)
        assert smallest.float().item() > 0.0
        assert torch.isfinite(largest.float()).item()
