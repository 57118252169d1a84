"""kl_estimate (k1, k2, k3, low_var_kl) and entropy_from_logits."""

import math

import pytest
import torch

from algorithms import KL_KINDS, entropy_from_logits, kl_estimate


def reference_kl(d, kind):
    """Schulman's estimators for one token, d = logp - ref_logp, in python floats."""
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2
    if kind == "low_var_kl":
        d = min(max(d, -20.0), 20.0)
        return min(max(math.exp(-d) - 1 + d, -10.0), 10.0)
    return math.exp(-d) - 1 + d


@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_matches_formula(kind):
    gen = torch.Generator().manual_seed(0)
    logp = -3 * torch.rand(4, 9, generator=gen, dtype=torch.float64)
    ref_logp = -3 * torch.rand(4, 9, generator=gen, dtype=torch.float64)
    rows = zip(logp.tolist(), ref_logp.tolist(), strict=True)
    expected = torch.tensor(
        [[reference_kl(a - b, kind) for a, b in zip(lp, rp, strict=True)] for lp, rp in rows], dtype=torch.float64
    )
    torch.testing.assert_close(kl_estimate(logp, ref_logp, kind), expected, rtol=1e-12, atol=1e-12)


def test_low_var_kl_clamps_log_ratio_and_result():
    logp = torch.tensor([[-30.0, 30.0, 0.0, -1.0]], dtype=torch.float64)
    ref = torch.zeros(1, 4, dtype=torch.float64)
    low_var = kl_estimate(logp, ref, "low_var_kl")
    k3 = kl_estimate(logp, ref, "k3")
    # d = -30: exp(30) - 31 is huge for k3, clamped to 10; d = 30: k3 is 29, clamped to 10.
    assert k3[0, 0].item() == pytest.approx(math.exp(30) - 31)
    assert low_var[0].tolist() == pytest.approx([10.0, 10.0, 0.0, math.exp(1) - 2])
    # The log-ratio clamp keeps exp finite, so a wild token gets gradient 0 rather than NaN.
    wild = torch.tensor([[-1000.0]], dtype=torch.float64, requires_grad=True)
    assert math.isinf(kl_estimate(wild.detach(), torch.zeros(1, 1), "k3").item())
    kl_estimate(wild, torch.zeros(1, 1), "low_var_kl").sum().backward()
    assert wild.grad.item() == 0.0


def test_k3_is_never_negative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(50, 50, generator=gen), torch.randn(50, 50, generator=gen)
    assert (kl_estimate(logp, ref, "k3") >= 0).all()
    assert torch.equal(kl_estimate(logp, logp, "k3"), torch.zeros(50, 50))


def test_k1_and_k3_are_unbiased_estimates_of_kl():
    gen = torch.Generator().manual_seed(2)
    policy = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
    reference = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), -1)
    true_kl = (policy * (policy / reference).log()).sum().item()
    tokens = torch.multinomial(policy, 400_000, replacement=True, generator=gen)
    logp, ref_logp = policy.log()[tokens].unsqueeze(0), reference.log()[tokens].unsqueeze(0)
    for kind in ("k1", "k3"):
        assert kl_estimate(logp, ref_logp, kind).mean().item() == pytest.approx(true_kl, abs=0.01)


def test_kl_gradcheck_and_dtypes():
    gen = torch.Generator().manual_seed(3)
    logp = torch.randn(2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 5, generator=gen, dtype=torch.float64)
    for kind in KL_KINDS:
        assert torch.autograd.gradcheck(lambda lp: kl_estimate(lp, ref, kind), (logp,))
    assert kl_estimate(logp.detach().bfloat16(), ref.bfloat16(), "k3").dtype == torch.float32


def test_unknown_kind_lists_allowed():
    with pytest.raises(ValueError, match=r"k1.*k2.*k3.*low_var_kl.*'k4'"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def reference_entropy(logits):
    out = torch.zeros(logits.shape[:2], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            row = [float(z) for z in logits[b, t]]
            top = max(row)
            weights = [math.exp(z - top) for z in row]
            total = sum(weights)
            out[b, t] = -sum(w / total * math.log(w / total) for w in weights if w > 0)
    return out


def test_entropy_matches_reference_including_huge_logits():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 4, 11, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits), reference_entropy(logits))
    huge = (1e4 * torch.randn(3, 4, 11, generator=gen)).float()
    result = entropy_from_logits(huge)
    assert result.dtype == torch.float32 and torch.isfinite(result).all()
    torch.testing.assert_close(result.double(), reference_entropy(huge.double()), rtol=1e-4, atol=1e-4)


def test_entropy_of_uniform_and_one_hot():
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, 50)), torch.full((2, 3), math.log(50)))
    one_hot = torch.full((1, 1, 8), -1e9)
    one_hot[..., 2] = 0.0
    assert entropy_from_logits(one_hot).item() == 0.0


def test_entropy_with_banned_tokens_is_finite_with_finite_gradient():
    logits = torch.randn(2, 3, 6, dtype=torch.float64)
    logits[..., :2] = float("-inf")
    logits.requires_grad_(True)
    entropy = entropy_from_logits(logits)
    entropy.sum().backward()
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach()[..., 2:]))
    assert torch.isfinite(logits.grad).all() and (logits.grad[..., :2] == 0).all()


def test_entropy_gradcheck():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy_from_logits, (logits,))
