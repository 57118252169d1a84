"""roles.trainer.objectives: the critic's value objective, both backends', held to a
hand-written float64 reference of the clipped value loss, split over micro-batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from roles.trainer.config import TrainerConfig
from roles.trainer.objectives import value_objective
from roles.trainer.sharding import aggregation_counts

BASE = dict(hf_checkpoint="x", seed=0, lr=1e-6, min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0,
            weight_decay=0.0, betas=(0.9, 0.999), clip_grad=1.0, global_batch_size=4, micro_batch_size=2, eps_clip=0.2,
            use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0,
            keep_ref=False)


def reference_value_loss(values, old_values, returns, valid, clip, mode) -> tuple[torch.Tensor, float]:
    """(loss, clipfrac) token by token in float64: max((v - R)^2, (v_old + clip(v - v_old) - R)^2),
    then the mode's mean (algorithms.aggregate's docstring)."""
    rows, tokens, clipped_tokens = [], 0, 0
    for i in range(values.shape[0]):
        row = []
        for t in range(values.shape[1]):
            if not valid[i, t]:
                continue
            v, v_old, ret = values[i, t].double(), float(old_values[i, t]), float(returns[i, t])
            unclipped = (v - ret) ** 2
            if clip is None:
                row.append(unclipped)
                continue
            clipped = (v_old + torch.clamp(v - v_old, -clip, clip) - ret) ** 2
            row.append(torch.maximum(unclipped, clipped))
            clipped_tokens += bool(clipped > unclipped)
        rows.append(row)
        tokens += len(row)
    zero = values.new_zeros((), dtype=torch.float64)
    if mode == "token-mean":
        loss = sum((x for row in rows for x in row), zero) / tokens
    elif mode == "seq-mean-token-sum":
        loss = sum((sum(row, zero) for row in rows if row), zero) / sum(1 for row in rows if row)
    else:
        means = [sum(row, zero) / len(row) for row in rows if row]
        denominator = len(rows) if mode == "sum-of-sample-mean" else len(means)
        loss = sum(means, zero) / denominator
    return loss, clipped_tokens / tokens


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "sum-of-sample-mean"])
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_objective_over_micro_batches_equals_a_float64_reference(mode, clip):
    g = torch.Generator().manual_seed(0)
    n, width = 5, 6
    old_values = torch.randn(n, width, generator=g)
    values = (old_values + 0.5 * torch.randn(n, width, generator=g)).requires_grad_()
    returns = torch.randn(n, width, generator=g)
    valid = torch.rand(n, width, generator=g) > 0.3
    valid[3] = False  # a row with no valid token: counted by sum-of-sample-mean only
    cfg = TrainerConfig(**BASE, value_clip=clip, loss_agg_mode=mode)
    counts = aggregation_counts(valid, mode)

    loss, clipfrac = torch.zeros((), dtype=torch.float64), 0.0
    for rows in ([0, 1], [2, 3, 4]):  # two micro-batches of one mini-batch
        mb = SimpleNamespace(response={"old_values": old_values[rows], "returns": returns[rows]}, valid=valid[rows])
        part, metrics = value_objective(cfg, values[rows], mb, counts)
        assert torch.equal(metrics["value_loss"], part.detach())
        loss = loss + part
        clipfrac += float(metrics["value_clipfrac"])
    (grad,) = torch.autograd.grad(loss, values)

    expect, expect_clipfrac = reference_value_loss(values, old_values, returns, valid, clip, mode)
    (expect_grad,) = torch.autograd.grad(expect, values)
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expect_grad, rtol=1e-5, atol=1e-7)
    assert clipfrac == pytest.approx(expect_clipfrac, abs=1e-6)
    if clip is not None:
        assert 0 < expect_clipfrac < 1  # the clip is exercised both ways
