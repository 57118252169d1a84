"""The suite's own plumbing (tests/conftest.py), run in an inner pytest session."""

from __future__ import annotations

import json
import tarfile

pytest_plugins = ["pytester"]


def test_a_gpu_tests_run_metrics_come_back_under_the_artifacts_dir_pass_or_fail(pytester, monkeypatch, tmp_path):
    """What `.ci/gpu` sets up on the device: each GPU test's metrics.jsonl files are appended to
    the tar file $TANDEM_TEST_ARTIFACTS as TEST__PATH after the test, a failing one too; CPU
    tests add nothing."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    pytester.makeconftest("from tests.conftest import gpu_run_metrics  # noqa: F401\n")
    pytester.makepyfile(test_runs='''
        import json
        import pytest

        def write(tmp_path, name, step):
            (tmp_path / name).mkdir()
            (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": step}) + "\\n")

        @pytest.mark.gpu
        def test_learns(tmp_path):
            write(tmp_path, "run", 0)
            assert False, "below the bar"

        @pytest.mark.gpu
        @pytest.mark.parametrize("mode", ["side"])
        def test_two_runs(tmp_path, mode):
            write(tmp_path, "sync", 1)
            write(tmp_path, mode, 2)

        def test_cpu(tmp_path):
            write(tmp_path, "run", 3)
    ''')
    artifacts = tmp_path / "out" / "metrics-main.tar"
    monkeypatch.setenv("TANDEM_TEST_ARTIFACTS", str(artifacts))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2, failed=1)
    with tarfile.open(artifacts) as tar:
        kept = {m.name: json.loads(tar.extractfile(m).read())["step"] for m in tar.getmembers()}
    assert kept == {"test_learns__run__metrics.jsonl": 0, "test_two_runs_side___sync__metrics.jsonl": 1,
                    "test_two_runs_side___side__metrics.jsonl": 2}
