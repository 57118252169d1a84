"""aggregate: every mode against a loop reference, and the data-parallel sharding contract."""

import pytest
import torch

from algorithms import AGG_MODES, aggregate, masked_mean


def reference_aggregate(values, mask, mode):
    """Whole-batch definitions, one row at a time, in python floats."""
    rows = []
    for b in range(mask.shape[0]):
        tokens = [float(values[b, t]) for t in range(mask.shape[1]) if mask[b, t]]
        rows.append(tokens)
    if mode == "token-mean":
        count = sum(len(r) for r in rows)
        return sum(sum(r) for r in rows) / count if count else 0.0
    non_empty = [r for r in rows if r]
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in non_empty) / len(non_empty) if non_empty else 0.0
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in non_empty) / len(non_empty) if non_empty else 0.0
    assert mode == "sum-of-sample-mean"
    return sum(sum(r) / len(r) for r in non_empty) / len(rows)


def random_losses(seed, batch=12, length=40):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch, 1), generator=gen)
    mask = (torch.arange(length) < lengths) & (torch.rand(batch, length, generator=gen) > 0.3)
    mask[3] = False  # an empty row inside the batch
    return values, mask.double()


def global_counts(mask, mode):
    """What a trainer all-reduces once per step: the whole batch's denominators."""
    tokens_per_row = mask.sum(-1)
    if mode == "token-mean":
        return {"global_token_count": int(tokens_per_row.sum())}
    if mode == "sum-of-sample-mean":
        return {"global_batch_size": mask.shape[0]}
    return {"global_batch_size": int((tokens_per_row > 0).sum())}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode):
    for seed in range(5):
        values, mask = random_losses(seed)
        assert aggregate(values, mask, mode).item() == pytest.approx(reference_aggregate(values, mask, mode), abs=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_shards_sum_to_whole_batch(mode, num_shards):
    values, mask = random_losses(seed=num_shards)
    whole = aggregate(values, mask, mode)
    counts = global_counts(mask, mode)
    shard_sum = sum(
        aggregate(v, m, mode, **counts)
        for v, m in zip(values.tensor_split(num_shards), mask.tensor_split(num_shards), strict=True)
    )
    torch.testing.assert_close(shard_sum, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_counts_may_be_tensors_from_an_all_reduce(mode):
    values, mask = random_losses(seed=11)
    counts = {name: torch.tensor(float(n)) for name, n in global_counts(mask, mode).items()}
    torch.testing.assert_close(aggregate(values, mask, mode, **counts), aggregate(values, mask, mode))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_sharded_gradients_sum_to_whole_batch_gradient(mode):
    values, mask = random_losses(seed=12)
    whole_values = values.clone().requires_grad_(True)
    aggregate(whole_values, mask, mode).backward()
    shard_values = values.clone().requires_grad_(True)
    counts = global_counts(mask, mode)
    for v, m in zip(shard_values.tensor_split(3), mask.tensor_split(3), strict=True):
        aggregate(v, m, mode, **counts).backward()
    torch.testing.assert_close(shard_values.grad, whole_values.grad, rtol=1e-12, atol=1e-12)


def test_sum_of_sample_mean_counts_empty_rows_seq_mean_does_not():
    values = torch.tensor([[2.0, 4.0], [9.0, 9.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(values, mask, "sum-of-sample-mean").item() == pytest.approx(3.0 / 2)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx(3.0)
    assert aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)
    assert aggregate(values, mask, "token-mean").item() == pytest.approx(3.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_all_masked_batch_gives_zero_and_finite_gradient(mode):
    values = torch.full((3, 5), float("nan"), requires_grad=True)
    loss = aggregate(values, torch.zeros(3, 5), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(3, 5))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_junk_at_masked_positions_is_ignored_in_value_and_gradient(mode):
    values, mask = random_losses(seed=13)
    junk = values.masked_fill(mask == 0, float("inf")).requires_grad_(True)
    loss = aggregate(junk, mask, mode)
    loss.backward()
    assert loss.item() == pytest.approx(reference_aggregate(values, mask, mode), abs=1e-12)
    assert torch.isfinite(junk.grad).all()
    assert (junk.grad[mask == 0] == 0).all()


def test_gradcheck_every_mode():
    values, mask = random_losses(seed=14, batch=4, length=6)
    values.requires_grad_(True)
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(lambda v: aggregate(v, mask, mode), (values,))


def test_bad_mode_and_counts_raise_value_error():
    values, mask = random_losses(seed=15)
    with pytest.raises(ValueError, match="token-mean.*sum-of-sample-mean"):
        aggregate(values, mask, "mean")
    with pytest.raises(ValueError, match="global_batch_size"):
        aggregate(values, mask, "sum-of-sample-mean", global_batch_size=0)
    with pytest.raises(ValueError, match="global_token_count"):
        aggregate(values, mask, "token-mean", global_token_count=-3)


def test_masked_mean_and_low_precision_input():
    values = torch.tensor([[1.0, 2.0, 100.0]], dtype=torch.bfloat16)
    result = masked_mean(values, torch.tensor([[1, 1, 0]]))
    assert result.dtype == torch.float32
    assert result.item() == 1.5
