"""Masked whitening, local and from moments summed over shards."""

import statistics

import pytest
import torch

from algorithms import masked_moments, masked_whiten, whiten_with_moments


def reference_whiten(x, mask, shift_mean=True, eps=1e-8):
    picked = [float(x[b, t]) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    mean, var = statistics.fmean(picked), statistics.variance(picked)  # variance: unbiased (n - 1)
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                out[b, t] = (float(x[b, t]) - mean) / (var + eps) ** 0.5 + (0.0 if shift_mean else mean)
    return out


def random_data(seed, batch=6, length=30, dtype=torch.float64, loc=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = loc + 3.0 * torch.randn(batch, length, generator=gen, dtype=dtype)
    mask = torch.rand(batch, length, generator=gen) > 0.4
    mask[1] = False
    return x, mask.long()


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_reference(shift_mean):
    x, mask = random_data(seed=0)
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=shift_mean), reference_whiten(x, mask, shift_mean))


def test_whitened_valid_values_have_zero_mean_unit_unbiased_std_and_masked_zeros():
    x, mask = random_data(seed=1, dtype=torch.float32)
    out = masked_whiten(x, mask)
    valid = mask.bool()
    assert out[valid].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out[valid].std().item() == pytest.approx(1.0, abs=1e-5)  # torch.std is unbiased
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))


def test_large_mean_in_float32_keeps_precision():
    x, mask = random_data(seed=2, dtype=torch.float32, loc=1e4)
    expected = reference_whiten(x.double(), mask)
    torch.testing.assert_close(masked_whiten(x, mask).double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_moments_summed_over_shards_whiten_like_the_whole_batch(num_shards):
    x, mask = random_data(seed=3, batch=8)
    xs, masks = x.tensor_split(num_shards), mask.tensor_split(num_shards)
    summed = sum(masked_moments(xi, mi) for xi, mi in zip(xs, masks, strict=True))  # what all_reduce(SUM) gives
    sharded = torch.cat([whiten_with_moments(xi, mi, summed) for xi, mi in zip(xs, masks, strict=True)])
    torch.testing.assert_close(sharded, masked_whiten(x, mask), rtol=1e-12, atol=1e-12)


def test_moments_are_float64_sums_and_count():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, 9.0, 9.0]], dtype=torch.bfloat16)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    moments = masked_moments(x, mask)
    assert moments.dtype == torch.float64
    assert moments.tolist() == [6.0, 14.0, 3.0]


def test_fewer_than_two_valid_elements_raise_value_error():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="at least 2 valid elements.*got 1"):
        masked_whiten(x, torch.tensor([[0, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="got 0"):
        masked_whiten(x, torch.zeros(2, 3))


def test_constant_input_gives_zeros_not_nan():
    out = masked_whiten(torch.full((2, 4), 7.0), torch.ones(2, 4))
    assert torch.equal(out, torch.zeros(2, 4))


def test_junk_at_masked_positions_is_ignored():
    x, mask = random_data(seed=4)
    junk = x.masked_fill(mask == 0, float("nan"))
    assert torch.equal(masked_whiten(junk, mask), masked_whiten(x, mask))


def test_whitening_is_differentiable_gradcheck():
    x, mask = random_data(seed=5, batch=3, length=5)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: masked_whiten(v, mask), (x,))
