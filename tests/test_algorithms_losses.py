"""policy_loss and value_loss: reference values, clip boundaries, zero-gradient regions, sharding."""

import math

import pytest
import torch

from algorithms import AGG_MODES, aggregate, policy_loss, value_loss


def reference_policy_tokens(logp, old_logp, adv, eps_low, eps_high, eps_c):
    """Per-token PPO loss written out case by case in python floats."""
    out = torch.zeros(logp.shape, dtype=torch.float64)
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            a = float(adv[b, t])
            ratio = math.exp(min(max(float(logp[b, t]) - float(old_logp[b, t]), -20.0), 20.0))
            clipped_ratio = min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = max(-a * ratio, -a * clipped_ratio)
            if eps_c is not None and a < 0:
                loss = min(loss, -a * eps_c)
            out[b, t] = loss
    return out


def reference_value_tokens(values, old_values, returns, clip):
    out = torch.zeros(values.shape, dtype=torch.float64)
    for b in range(values.shape[0]):
        for t in range(values.shape[1]):
            v, v_old, ret = float(values[b, t]), float(old_values[b, t]), float(returns[b, t])
            v_clipped = min(max(v, v_old - clip), v_old + clip)
            out[b, t] = max((v - ret) ** 2, (v_clipped - ret) ** 2)
    return out


def random_policy_batch(seed, batch=6, length=20):
    gen = torch.Generator().manual_seed(seed)
    old_logp = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    logp = old_logp + 0.4 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) > 0.25
    mask[2] = False
    return logp, old_logp, adv, mask.double()


def one_token(log_ratio, advantage):
    """Single valid token: logp (requires grad), old_logp, advantage, mask."""
    logp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[advantage]], dtype=torch.float64)
    return logp, torch.zeros(1, 1, dtype=torch.float64), advantages, torch.ones(1, 1)


def loss_and_grad(log_ratio, advantage, **kwargs):
    logp, old_logp, adv, mask = one_token(log_ratio, advantage)
    loss, metrics = policy_loss(logp, old_logp, adv, mask, agg="token-mean", **kwargs)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# ---- policy loss ----------------------------------------------------------------


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("eps_clip_high,eps_clip_c", [(None, None), (0.28, None), (None, 3.0), (0.28, 2.0)])
def test_policy_loss_matches_reference(agg, eps_clip_high, eps_clip_c):
    logp, old_logp, adv, mask = random_policy_batch(seed=0)
    loss, _ = policy_loss(logp, old_logp, adv, mask, 0.2, eps_clip_high, eps_clip_c, agg=agg)
    tokens = reference_policy_tokens(logp, old_logp, adv, 0.2, eps_clip_high or 0.2, eps_clip_c)
    torch.testing.assert_close(loss, aggregate(tokens, mask, agg), rtol=1e-12, atol=1e-12)


def test_unclipped_region_gradient_is_minus_advantage_times_ratio():
    for log_ratio, advantage in [(0.1, 2.0), (-0.1, -1.5), (-0.5, 1.0), (0.5, -1.0)]:
        loss, grad, metrics = loss_and_grad(log_ratio, advantage)
        ratio = math.exp(log_ratio)
        assert loss == pytest.approx(-advantage * ratio)
        assert grad == pytest.approx(-advantage * ratio)
        assert metrics["pg_clipfrac"].item() == 0.0


def test_clip_region_has_zero_gradient():
    # A > 0 above 1 + eps, and A < 0 below 1 - eps: the clipped term is constant.
    for log_ratio, advantage, bound in [(math.log(1.3), 2.0, 1.2), (math.log(0.7), -1.0, 0.8)]:
        loss, grad, metrics = loss_and_grad(log_ratio, advantage)
        assert loss == pytest.approx(-advantage * bound)
        assert grad == 0.0
        assert metrics["pg_clipfrac"].item() == 1.0


def test_clip_higher_moves_only_the_upper_boundary():
    delta = 1e-3
    inside = loss_and_grad(math.log(1.28 - delta), 1.0, eps_clip_high=0.28)
    outside = loss_and_grad(math.log(1.28 + delta), 1.0, eps_clip_high=0.28)
    assert inside[1] == pytest.approx(-(1.28 - delta)) and inside[2]["pg_clipfrac"].item() == 0.0
    assert outside[1] == 0.0 and outside[0] == pytest.approx(-1.28) and outside[2]["pg_clipfrac"].item() == 1.0
    # The same ratio is clipped without clip-higher, and the lower bound stays at 1 - eps_clip.
    assert loss_and_grad(math.log(1.28 - delta), 1.0)[1] == 0.0
    assert loss_and_grad(math.log(0.8 - delta), -1.0, eps_clip_high=0.28)[1] == 0.0
    assert loss_and_grad(math.log(0.8 + delta), -1.0, eps_clip_high=0.28)[1] == pytest.approx(0.8 + delta)


def test_dual_clip_caps_negative_advantage_loss_with_zero_gradient():
    delta = 1e-3
    below = loss_and_grad(math.log(3.0 - delta), -2.0, eps_clip_c=3.0)
    above = loss_and_grad(math.log(3.0 + delta), -2.0, eps_clip_c=3.0)
    assert below[0] == pytest.approx(2.0 * (3.0 - delta)) and below[1] == pytest.approx(2.0 * (3.0 - delta))
    assert below[2]["pg_clipfrac_lower"].item() == 0.0
    assert above[0] == pytest.approx(6.0) and above[1] == 0.0
    assert above[2]["pg_clipfrac_lower"].item() == 1.0
    # Without dual clip the same token keeps growing; positive advantages are never dual-clipped.
    assert loss_and_grad(math.log(3.0 + delta), -2.0)[0] == pytest.approx(2.0 * (3.0 + delta))
    assert loss_and_grad(math.log(5.0), 2.0, eps_clip_c=3.0)[2]["pg_clipfrac_lower"].item() == 0.0


def test_log_ratio_is_clamped_to_20():
    loss, grad, metrics = loss_and_grad(50.0, -1.0)
    assert loss == pytest.approx(math.exp(20.0))
    assert grad == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-20.0)


def test_metrics_are_detached_float32_token_means():
    logp, old_logp, adv, mask = random_policy_batch(seed=1)
    logp.requires_grad_(True)
    _, metrics = policy_loss(logp, old_logp, adv, mask, eps_clip_c=3.0)
    assert set(metrics) >= {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    for value in metrics.values():
        assert value.dtype == torch.float32 and value.dim() == 0 and not value.requires_grad
    valid = mask.bool()
    expected_kl = (old_logp - logp.detach())[valid].mean().item()
    assert metrics["ppo_kl"].item() == pytest.approx(expected_kl, rel=1e-5)
    ratio = (logp.detach() - old_logp).exp()
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped[valid].double().mean().item(), rel=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_gradcheck(agg):
    logp, old_logp, adv, mask = random_policy_batch(seed=2, batch=3, length=5)
    logp.requires_grad_(True)
    adv.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda lp, a: policy_loss(lp, old_logp, a, mask, eps_clip_high=0.3, eps_clip_c=2.0, agg=agg)[0], (logp, adv)
    )


@pytest.mark.parametrize("agg", AGG_MODES)
def test_policy_loss_shards_sum_to_whole(agg):
    logp, old_logp, adv, mask = random_policy_batch(seed=3, batch=8)
    whole, _ = policy_loss(logp, old_logp, adv, mask, agg=agg)
    tokens_per_row = mask.sum(-1)
    counts = {
        "global_token_count": tokens_per_row.sum(),
        "global_batch_size": mask.shape[0] if agg == "sum-of-sample-mean" else (tokens_per_row > 0).sum(),
    }
    shards = zip(*(t.tensor_split(4) for t in (logp, old_logp, adv, mask)), strict=True)
    total = sum(policy_loss(*shard, agg=agg, **counts)[0] for shard in shards)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_padding_with_infinite_logprobs_and_all_masked_rows_stay_finite():
    logp, old_logp, adv, mask = random_policy_batch(seed=4)
    hidden = mask == 0
    logp = logp.masked_fill(hidden, float("-inf")).requires_grad_(True)
    old_logp = old_logp.masked_fill(hidden, float("-inf"))
    loss, metrics = policy_loss(logp, old_logp, adv.masked_fill(hidden, float("nan")), mask, eps_clip_c=3.0)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(m) for m in metrics.values())
    assert torch.isfinite(logp.grad).all() and (logp.grad[hidden] == 0).all()
    empty_loss, empty_metrics = policy_loss(logp.detach(), old_logp, adv, torch.zeros_like(mask))
    assert empty_loss.item() == 0.0 and all(m.item() == 0.0 for m in empty_metrics.values())


def test_policy_loss_rejects_bad_clip_settings():
    logp, old_logp, adv, mask = random_policy_batch(seed=5)
    with pytest.raises(ValueError, match="eps_clip_c .* must be > 1, got 1.0"):
        policy_loss(logp, old_logp, adv, mask, eps_clip_c=1.0)
    with pytest.raises(ValueError, match="eps_clip must be in"):
        policy_loss(logp, old_logp, adv, mask, eps_clip=1.5)
    with pytest.raises(ValueError, match="eps_clip_high must be > 0"):
        policy_loss(logp, old_logp, adv, mask, eps_clip_high=-0.1)
    with pytest.raises(ValueError, match="aggregation mode"):
        policy_loss(logp, old_logp, adv, mask, agg="sum")
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(logp, old_logp, adv[:, :3], mask)


# ---- value loss -----------------------------------------------------------------


def random_value_batch(seed, batch=6, length=20):
    gen = torch.Generator().manual_seed(seed)
    old_values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = old_values + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    returns = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) > 0.25
    mask[0] = False
    return values, old_values, returns, mask.double()


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_matches_reference(agg):
    values, old_values, returns, mask = random_value_batch(seed=6)
    loss, metrics = value_loss(values, old_values, returns, mask, value_clip=0.2, agg=agg)
    tokens = reference_value_tokens(values, old_values, returns, 0.2)
    torch.testing.assert_close(loss, aggregate(tokens, mask, agg), rtol=1e-12, atol=1e-12)
    unclipped = (values - returns) ** 2
    assert metrics["value_clipfrac"].item() == pytest.approx(
        (tokens > unclipped)[mask.bool()].double().mean().item(), rel=1e-6
    )


def test_value_loss_has_no_half_factor_and_clip_region_has_zero_gradient():
    def single(v, v_old, ret, **kwargs):
        value = torch.tensor([[v]], dtype=torch.float64, requires_grad=True)
        args = (torch.tensor([[v_old]], dtype=torch.float64), torch.tensor([[ret]], dtype=torch.float64))
        loss, metrics = value_loss(value, *args, torch.ones(1, 1), agg="token-mean", **kwargs)
        loss.backward()
        return loss.item(), value.grad.item(), metrics["value_clipfrac"].item()

    assert single(0.5, 0.4, 1.0) == pytest.approx((0.25, -1.0, 0.0))  # inside the clip range
    assert single(0.5, 0.0, 1.0) == pytest.approx((0.64, 0.0, 1.0))  # moved 0.5 towards R: clipped at 0.2
    assert single(-0.5, 0.0, 1.0) == pytest.approx((2.25, -3.0, 0.0))  # moved away from R: unclipped
    assert single(0.5, 0.0, 1.0, value_clip=None) == pytest.approx((0.25, -1.0, 0.0))


def test_value_loss_gradcheck_and_shards():
    values, old_values, returns, mask = random_value_batch(seed=7, batch=4, length=5)
    values.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old_values, returns, mask)[0], (values,))
    whole, _ = value_loss(values, old_values, returns, mask)
    shards = zip(*(t.tensor_split(2) for t in (values, old_values, returns, mask)), strict=True)
    total = sum(value_loss(*shard, global_batch_size=4)[0] for shard in shards)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)


def test_value_loss_ignores_masked_junk_and_rejects_bad_clip():
    values, old_values, returns, mask = random_value_batch(seed=8)
    hidden = mask == 0
    junk = values.masked_fill(hidden, float("nan")).requires_grad_(True)
    loss, metrics = value_loss(junk, old_values, returns.masked_fill(hidden, float("inf")), mask)
    loss.backward()
    torch.testing.assert_close(loss, value_loss(values, old_values, returns, mask)[0])
    assert torch.isfinite(junk.grad).all() and torch.isfinite(metrics["value_clipfrac"])
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        value_loss(values, old_values, returns, mask, value_clip=0.0)
