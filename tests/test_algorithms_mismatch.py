"""TIS, masked IS, GSPO and mismatch metrics against float64 references written from the papers'
formulas (Yao et al. 2025 for TIS; miles' mis.py for the metrics; Zheng et al. 2025 for GSPO),
one token at a time in python floats, under every loss aggregation mode."""

import math

import pytest
import torch

from algorithms import (
    AGG_MODES,
    masked_is,
    mismatch_metrics,
    policy_loss,
    reduce_metrics,
    sequence_masked_is,
    truncated_is,
)


def ref_aggregate(tokens: list[list[float]], mode: str) -> float:
    """tokens: each row's valid per-token values (empty rows included)."""
    non_empty = [r for r in tokens if r]
    if mode == "token-mean":
        n = sum(len(r) for r in tokens)
        return sum(map(sum, tokens)) / n if n else 0.0
    if mode == "seq-mean-token-sum":
        return sum(map(sum, non_empty)) / len(non_empty) if non_empty else 0.0
    means = sum(sum(r) / len(r) for r in non_empty)
    if mode == "seq-mean-token-mean":
        return means / len(non_empty) if non_empty else 0.0
    assert mode == "sum-of-sample-mean"
    return means / len(tokens)


def rows_of(x, mask):
    return [[float(x[b, t]) for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]


def mismatch_batch(seed, batch=7, length=12):
    """Trainer and engine log-probs of the same tokens; padding holds junk (inf/NaN) that must
    not leak; row 3 is empty; one token is wildly off (ratio e^5) and one the other way."""
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    train = rollout + 0.3 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths).double()
    mask[3] = 0
    train[0, 0] = rollout[0, 0] + 5.0
    train[1, 0] = rollout[1, 0] - 5.0
    mask[0, 0] = mask[1, 0] = 1
    train = torch.where(mask.bool(), train, float("nan"))
    rollout = torch.where(mask.bool(), rollout, float("-inf"))
    return train, rollout, mask


# ---- importance weights -----------------------------------------------------------------


@pytest.mark.parametrize("low,high", [(0.0, 2.0), (0.5, 1.5)])
def test_truncated_is_is_the_clamped_ratio(low, high):
    train, rollout, mask = mismatch_batch(0)
    weights, metrics = truncated_is(train_log_probs=train, rollout_log_probs=rollout, mask=mask,
                                    tis_clip=high, tis_clip_low=low)
    ref = torch.zeros_like(weights)
    clipped = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                ratio = math.exp(float(train[b, t]) - float(rollout[b, t]))
                ref[b, t] = min(max(ratio, low), high)
                clipped.append(ratio < low or ratio > high)
    torch.testing.assert_close(weights, ref, rtol=1e-12, atol=0)
    assert not weights.requires_grad
    reduced = reduce_metrics(metrics, mask)
    assert set(reduced) == {"tis", "tis_abs", "tis_clipfrac", "tis_weight"}
    ref_clipfrac = ref_aggregate([[float(min(max(r, low), high) != r) for r in row]
                                  for row in [[math.exp(a - b) for a, b in zip(tr, ro)]
                                              for tr, ro in zip(rows_of(train, mask), rows_of(rollout, mask))]],
                                 "seq-mean-token-mean")
    assert reduced["tis_clipfrac"] == pytest.approx(ref_clipfrac, abs=1e-12)
    assert reduced["tis_clipfrac"] > 0 and any(clipped)
    assert reduced["tis_weight"] == pytest.approx(ref_aggregate(rows_of(ref, mask), "seq-mean-token-mean"))


def test_masked_is_rejects_tokens_outside_the_bounds_and_keeps_the_ratio_inside():
    train, rollout, mask = mismatch_batch(1)
    weights, _ = masked_is(train_log_probs=train, rollout_log_probs=rollout, mask=mask, tis_clip=2.0, tis_clip_low=0.5)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            ratio = math.exp(float(train[b, t]) - float(rollout[b, t])) if mask[b, t] else 0.0
            want = ratio if mask[b, t] and 0.5 <= ratio <= 2.0 else 0.0
            assert float(weights[b, t]) == pytest.approx(want, rel=1e-12, abs=0)
    assert weights[0, 0] == 0 and weights[1, 0] == 0  # e^5 and e^-5


def test_sequence_masked_is_rejects_whole_sequences_by_their_geometric_mean_ratio():
    train, rollout, mask = mismatch_batch(2)
    weights, metrics = sequence_masked_is(train_log_probs=train, rollout_log_probs=rollout, mask=mask,
                                          tis_clip=1.2, tis_clip_low=0.8)
    rejected = []
    for b in range(mask.shape[0]):
        logs = [float(train[b, t]) - float(rollout[b, t]) for t in range(mask.shape[1]) if mask[b, t]]
        geo = math.exp(sum(logs) / len(logs)) if logs else 1.0
        keep = 0.8 <= geo <= 1.2
        if logs:
            rejected.append(not keep)
        for t in range(mask.shape[1]):
            want = 0.0
            if mask[b, t] and keep:
                want = min(max(math.exp(float(train[b, t]) - float(rollout[b, t])), 0.8), 1.2)
            assert float(weights[b, t]) == pytest.approx(want, rel=1e-12, abs=0)
    assert any(rejected) and not all(rejected)
    got = reduce_metrics(metrics, mask)["tis_seq_rejectfrac"]
    assert got == pytest.approx(sum(rejected) / len(rejected))


@pytest.mark.parametrize("fn", [truncated_is, masked_is, sequence_masked_is])
def test_weights_are_finite_and_zero_on_padding_and_bad_bounds_raise(fn):
    train, rollout, mask = mismatch_batch(3)
    train[2, 1] = rollout[2, 1] + 80.0  # past the safety bound: exp stays finite
    mask[2, 1] = 1
    weights, metrics = fn(train_log_probs=train, rollout_log_probs=rollout, mask=mask, tis_clip=2.0)
    assert torch.isfinite(weights).all() and (weights[mask == 0] == 0).all()
    assert all(math.isfinite(v) for v in reduce_metrics(metrics, mask).values())
    empty, _ = fn(train_log_probs=train, rollout_log_probs=rollout, mask=torch.zeros_like(mask), tis_clip=2.0)
    assert (empty == 0).all()
    for low, high in ((1.0, 1.0), (-0.1, 2.0), (3.0, 2.0)):
        with pytest.raises(ValueError, match="tis_clip_low"):
            fn(train_log_probs=train, rollout_log_probs=rollout, mask=mask, tis_clip=high, tis_clip_low=low)


# ---- mismatch metrics ---------------------------------------------------------------------


def test_mismatch_metrics_match_their_formulas():
    train, rollout, mask = mismatch_batch(4)
    got = reduce_metrics(mismatch_metrics(train, rollout, mask), mask)
    per_seq = {k: [] for k in got}
    token_rows = {"kl": [], "k3_kl": []}
    for tr, ro in zip(rows_of(train, mask), rows_of(rollout, mask)):
        if not tr:
            continue
        n = len(tr)
        mt, mr = sum(tr) / n, sum(ro) / n
        logs = [a - b for a, b in zip(tr, ro)]
        per_seq["training_log_ppl"].append(-mt)
        per_seq["training_ppl"].append(math.exp(-mt))
        per_seq["rollout_log_ppl"].append(-mr)
        per_seq["rollout_ppl"].append(math.exp(-mr))
        per_seq["log_ppl_diff"].append(mr - mt)
        per_seq["log_ppl_abs_diff"].append(abs(mr - mt))
        per_seq["ppl_ratio"].append(math.exp(mr - mt))
        per_seq["chi2_token"].append(sum(math.exp(x) ** 2 for x in logs) / n - 1)
        per_seq["chi2_seq"].append(math.exp(2 * max(min(sum(logs), 20.0), -20.0)) - 1)
        per_seq["kl"].append(sum(-x for x in logs) / n)
        per_seq["k3_kl"].append(sum(math.exp(x) - x - 1 for x in logs) / n)
    assert set(got) == set(per_seq) and token_rows
    for k, vals in per_seq.items():
        assert got[k] == pytest.approx(sum(vals) / len(vals), rel=1e-10), k
    assert got["k3_kl"] >= 0


def test_mismatch_metrics_are_zero_when_the_engines_agree():
    _, rollout, mask = mismatch_batch(5)
    got = reduce_metrics(mismatch_metrics(rollout.clone(), rollout, mask), mask)
    for k in ("kl", "k3_kl", "log_ppl_diff", "log_ppl_abs_diff", "chi2_token", "chi2_seq"):
        assert got[k] == pytest.approx(0.0, abs=1e-12), k
    assert got["ppl_ratio"] == pytest.approx(1.0)


# ---- policy loss with importance weights, and GSPO ---------------------------------------------


def policy_batch(seed, batch=6, length=10):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.15 * torch.randn(batch, length, generator=gen, dtype=torch.float64)
    adv = torch.randn(batch, 1, generator=gen, dtype=torch.float64).expand(batch, length).clone()
    lengths = torch.randint(1, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths).double()
    mask[2] = 0
    logp = torch.where(mask.bool(), logp, float("nan"))
    return logp, old, adv, mask


def ppo_token(ratio, a, eps_low, eps_high, eps_c):
    loss = max(-a * ratio, -a * min(max(ratio, 1 - eps_low), 1 + eps_high))
    if eps_c is not None and a < 0:
        loss = min(loss, -a * eps_c)
    return loss


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("eps_high,eps_c", [(0.2, None), (0.28, 3.0)])
def test_is_weights_multiply_each_tokens_clipped_loss(agg, eps_high, eps_c):
    logp, old, adv, mask = policy_batch(0)
    w = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) * 2
    w[0, :3] = 0  # rejected tokens: out of the numerator, still in the denominators
    w = torch.where(mask.bool(), w, float("inf"))  # junk on padding must not leak
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, eps_high, eps_c, agg=agg, is_weights=w)
    rows = []
    for b in range(mask.shape[0]):
        rows.append([float(w[b, t]) * ppo_token(math.exp(float(logp[b, t]) - float(old[b, t])), float(adv[b, t]),
                                                0.2, eps_high, eps_c)
                     for t in range(mask.shape[1]) if mask[b, t]])
    assert float(loss) == pytest.approx(ref_aggregate(rows, agg), rel=1e-12, abs=1e-14)
    ratios = [math.exp(float(logp[b, t]) - float(old[b, t])) for b in range(6) for t in range(10) if mask[b, t]]
    assert float(metrics["ois"]) == pytest.approx(sum(ratios) / len(ratios), rel=1e-6)


def test_is_weights_are_constants_in_the_gradient():
    logp, old, adv, mask = policy_batch(1)
    logp = torch.where(mask.bool(), logp, 0.0).requires_grad_()
    w = torch.full(mask.shape, 0.5, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, mask, agg="token-mean", is_weights=w)
    loss.backward()
    assert w.grad is None
    logp2 = logp.detach().clone().requires_grad_()
    half, _ = policy_loss(logp2, old, adv, mask, agg="token-mean")
    (0.5 * half).backward()
    torch.testing.assert_close(logp.grad, logp2.grad)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("eps,eps_high,eps_c", [(0.2, 0.2, None), (3e-4, 4e-4, None), (0.05, 0.1, 2.0)])
def test_gspo_matches_the_sequence_level_objective(agg, eps, eps_high, eps_c):
    """GSPO eq. 5-7: s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|), one clipped term per
    response, repeated over its tokens and aggregated like any per-token loss."""
    logp, old, adv, mask = policy_batch(2)
    loss, metrics = policy_loss(logp, old, adv, mask, eps, eps_high, eps_c, agg=agg, ratio_level="sequence")
    rows, kls = [], []
    for b in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not idx:
            rows.append([])
            continue
        log_s = sum(float(logp[b, t]) - float(old[b, t]) for t in idx) / len(idx)
        term = ppo_token(math.exp(log_s), float(adv[b, 0]), eps, eps_high, eps_c)
        rows.append([term] * len(idx))
        kls += [-log_s] * len(idx)
    assert float(loss) == pytest.approx(ref_aggregate(rows, agg), rel=1e-12, abs=1e-14)
    assert float(metrics["ppo_kl"]) == pytest.approx(sum(kls) / len(kls), rel=1e-6)


def test_gspo_gradient_spreads_the_sequence_ratio_over_its_tokens():
    """Unclipped: d(-A s)/d logp_t = -A s / |y| for every valid token, 0 on padding."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.01, -1.99, -0.5, 0.0]], dtype=torch.float64)
    adv = torch.full((1, 4), 0.7, dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logp, old, adv, mask, agg="sum-of-sample-mean", ratio_level="sequence")
    loss.backward()
    s = math.exp((0.01 - 0.01 + 0.0) / 3)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.7 * s / 3] * 3 + [0.0]], dtype=torch.float64))


def test_gspo_equals_ppo_on_one_token_responses_and_rejects_unknown_levels():
    logp, old, adv, mask = policy_batch(3, length=1)
    for agg in AGG_MODES:
        a, _ = policy_loss(logp, old, adv, mask, agg=agg, ratio_level="sequence")
        b, _ = policy_loss(logp, old, adv, mask, agg=agg)
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="ratio_level"):
        policy_loss(logp, old, adv, mask, ratio_level="geometric")


def test_mismatch_metrics_resolve_float32_sized_gaps():
    """Engines that agree to ~1e-7 (the CPU run): k3 KL and chi2 stay >= 0 and of the right size
    rather than rounding to 0 or below."""
    rollout = torch.full((1, 4), -1.0, dtype=torch.float32)
    train = rollout + torch.tensor([[2e-7, -2e-7, 3e-7, 1e-7]])
    got = reduce_metrics(mismatch_metrics(train, rollout, torch.ones(1, 4)), torch.ones(1, 4))
    logs = (train.double() - rollout.double())[0].tolist()
    assert got["k3_kl"] == pytest.approx(sum(x * x / 2 for x in logs) / 4, rel=1e-4)
    assert got["chi2_token"] == pytest.approx(sum(2 * x for x in logs) / 4, rel=1e-4)
