"""The loss of partial-rollout samples (algorithms.partial, docs/partial_rollouts.md) against a slow
float64 twin that walks each response segment by segment: a carried segment, sampled by an older
policy, is weighted by TIS against that policy's log-probs (the loop's mismatch_correction), or,
with --mask-offpolicy-in-partial-rollout, left out of the loss and of its token counts."""

import math

import pytest
import torch

from algorithms import policy_loss, truncated_is
from algorithms.partial import offpolicy_metrics, version_lag

EPS, TIS_CLIP = 0.2, 2.0


def segment_batch(seed: int = 0, rows: int = 5, width: int = 9):
    """Rows of two segments each: tokens [0, cut) sampled by version 3 (carried from an earlier
    rollout), [cut, len) by version 4, the trainer's; padding after len."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, width + 1, (rows,), generator=g)
    cuts = torch.stack([torch.randint(0, int(n) + 1, (1,), generator=g)[0] for n in lens])
    pos = torch.arange(width)
    mask = (pos[None] < lens[:, None]).double()
    carried = (pos[None] < cuts[:, None]) & (mask > 0)
    versions = torch.where(carried, 3, 4) * (mask > 0)
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3  # trainer, version 4
    engine_now = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.01
    engine_before = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.7  # version 3's
    rollout = torch.where(carried, engine_before, engine_now) * mask
    logp = old + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.3  # after some updates
    adv = torch.randn(rows, width, generator=g, dtype=torch.float64)
    return dict(lens=lens.tolist(), cuts=cuts.tolist(), mask=mask, versions=versions, old=old, rollout=rollout,
                logp=logp, adv=adv)


def reference(b: dict, masked_carry: bool) -> float:
    """sum-of-sample-mean over rows of the clipped surrogate, segment by segment, in Python floats."""
    total = 0.0
    for i, (n, cut) in enumerate(zip(b["lens"], b["cuts"])):
        segments = [(cut, n, False)] if masked_carry else [(0, cut, True), (cut, n, False)]
        row_sum, row_tokens = 0.0, 0
        for start, end, _ in segments:
            for t in range(start, end):
                ratio = math.exp(float(b["logp"][i, t] - b["old"][i, t]))
                a = float(b["adv"][i, t])
                per_token = max(-a * ratio, -a * min(max(ratio, 1 - EPS), 1 + EPS))
                if not masked_carry:  # TIS against the policy that sampled the token's segment
                    per_token *= min(max(math.exp(float(b["old"][i, t] - b["rollout"][i, t])), 0.0), TIS_CLIP)
                row_sum += per_token
                row_tokens += 1
        total += row_sum / max(row_tokens, 1)
    return total / len(b["lens"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_carried_segments_weighted_by_tis_against_their_own_policy_match_the_float64_reference(seed):
    b = segment_batch(seed)
    weights, _ = truncated_is(train_log_probs=b["old"], rollout_log_probs=b["rollout"], mask=b["mask"],
                              tis_clip=TIS_CLIP, tis_clip_low=0.0)
    loss, _ = policy_loss(b["logp"], b["old"], b["adv"], b["mask"], eps_clip=EPS, is_weights=weights)
    assert loss.dtype == torch.float64
    assert float(loss) == pytest.approx(reference(b, masked_carry=False), rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_carried_segments_leave_the_loss_and_its_counts_match_the_float64_reference(seed):
    b = segment_batch(seed)
    mask = b["mask"] * (b["versions"] == 4)  # the loss mask ppo.generate.partial gives under the flag
    loss, _ = policy_loss(b["logp"], b["old"], b["adv"], mask, eps_clip=EPS)
    assert float(loss) == pytest.approx(reference(b, masked_carry=True), rel=1e-12, abs=1e-14)


def test_offpolicy_metrics_count_lagging_tokens_and_their_tis_weight():
    versions = torch.tensor([[3, 3, 4, 0], [4, 4, 4, 4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    tis = torch.tensor([[0.5, 1.5, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert version_lag(versions, mask, 4).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]
    assert offpolicy_metrics(versions, mask, 4, tis) == {
        "offpolicy_token_share": 2 / 5, "version_lag_mean": 2 / 5, "version_lag_max": 1.0,
        "offpolicy_tis_weight": 1.0}
    assert offpolicy_metrics(versions, mask * 0, 4)["version_lag_max"] == 0.0  # all masked: finite, zero


def test_a_token_newer_than_the_trainer_is_refused():
    with pytest.raises(ValueError, match="weight version 5 is newer than the trainer's 4"):
        version_lag(torch.tensor([[5]]), torch.tensor([[1]]), 4)
