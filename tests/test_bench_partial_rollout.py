"""bench/partial_rollout.py at tiny shape on the CPU: both modes run through the driver's rollout
functions on a real engine process, train the same samples per step, and the ratio is printed."""

import pytest

from bench import partial_rollout as bench


@pytest.mark.timeout(120)
def test_the_benchmark_times_plain_and_partial_rollouts_side_by_side(capsys):
    results = bench.main(["--steps", "2", "--rollout-batch-size", "2", "--over-sampling-batch-size", "3",
                          "--n-samples-per-prompt", "4"])
    assert results["plain"]["samples"] == results["partial"]["samples"] == 8
    assert results["plain"]["seconds"] > 0 and results["partial"]["seconds"] > 0
    assert results["ratio"] == pytest.approx(results["plain"]["seconds"] / results["partial"]["seconds"])
    out = capsys.readouterr().out
    assert "plain/partial" in out and f"{results['ratio']:.2f}x" in out


def test_lengths_are_lognormal_with_the_asked_mean_and_cut():
    import numpy as np

    lens = bench.lengths(np.random.default_rng(0), 20000, 1500.0, 8192)
    assert max(lens) == 8192 and min(lens) >= 1
    assert 1350 < sum(lens) / len(lens) < 1550  # the cut takes a little off the mean
