"""bench.trainer's report on the CPU: a row shows the median run's MFU with the runs' spread."""

from bench.trainer import RUNS, markdown


def test_a_row_reports_the_median_run_and_the_spread():
    row = {"backend": "megatron", "tokens": 8192, "recompute": "none", "step_s": 0.5, "step_s_runs": [0.55, 0.5, 0.45],
           "mfu": 0.431, "mfu_min": 0.398, "mfu_max": 0.473, "logprob_s": 0.1, "peak_gib": 60.0, "above_state_gib": 4.0}
    text = markdown({"pinned": {"d2h": 55.0, "h2d": 55.0}, "matmul_tflops": 800.0, "memcpy_gbps": 2000.0,
                     "rows": [row, {"backend": "torch", "tokens": 8192, "recompute": "x", "skipped": "time budget"}]})
    assert f"train step s (median of {RUNS})" in text
    assert "| megatron | 8192 | none | 0.500 | 43.1% (39.8%-47.3%) | 0.100 | 60.0 | 4.0 |" in text
    assert "| torch | 8192 | x | time budget |" in text
