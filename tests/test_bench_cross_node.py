"""bench.cross_node runs its three setups end to end in a short run (it checks first that the
batch comes back unchanged through each, CURVE included)."""

import math

import pytest

from bench.cross_node import SETUPS, main


@pytest.mark.timeout(120)
def test_a_short_run_reports_every_setup_with_finite_times(capsys):
    rows = main(["--calls", "20", "--mib", "1"])
    assert list(rows) == list(SETUPS)
    for setup, row in rows.items():
        assert all(math.isfinite(v) and v > 0 for v in row.values()), (setup, row)
        assert row["p50_us"] <= row["p99_us"]
    assert "tcp + CURVE" in capsys.readouterr().out
