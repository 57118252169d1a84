"""roles.compute_check: the check run in each role's MPS client side by side
(ppo.side_by_side.check_roles). Its verdict on the CPU, on a matmul that leaves an output
unwritten or wrong and a copy that writes nothing, and (`bash .ci/gpu -k compute_check`) on the
GPU without MPS."""

import json

import pytest
import torch

from roles.compute_check import COPY_SIZES, LAYOUTS, SHAPES, check, main, wrong_copies, wrong_gemms

SMALL = [s for s in SHAPES if max(s) <= 1024]  # the CPU's bf16 GEMMs: the 4096-wide ones take seconds each


def test_right_gemms_and_copies_pass():
    assert wrong_gemms("cpu", shapes=SMALL) == []
    assert wrong_copies("cpu") == []


def test_a_gemm_left_unwritten_or_wrong_is_named_by_its_layout_and_shape():
    """As cuBLAS did under MPS at 75% on the H200: the output block returned untouched (NaN)."""
    unwritten, wrong = ("forward", *SMALL[0]), ("wgrad", *SMALL[3])
    x, w, dy = (torch.empty(m, k) for m, k in ((wrong[1], wrong[2]), (wrong[3], wrong[2]), (wrong[1], wrong[3])))
    wgrad_operands = tuple(t.shape for t in LAYOUTS["wgrad"](x, w, dy))
    m, k, n = unwritten[1:]

    def matmul(a, b):
        if (a.shape, b.shape) == ((m, k), (k, n)):
            return torch.full((m, n), float("nan"), dtype=a.dtype)
        return a @ b * (1.1 if (a.shape, b.shape) == wgrad_operands else 1)

    assert wrong_gemms("cpu", matmul, SMALL) == [unwritten, wrong]


def test_a_copy_that_writes_nothing_is_named_by_its_size():
    assert wrong_copies("cpu", copy=lambda dst, src: None) == COPY_SIZES


def test_the_check_repeats_for_its_seconds_and_counts_every_check():
    report = check("cpu", seconds=0.3, shapes=SMALL[:1])
    assert report["rounds"] > 1 and report["wrong"] == [] and report["copy"] == []
    assert report["checked"] == 3 + len(COPY_SIZES)  # three layouts of one shape, and the copies


def test_without_cuda_the_module_says_it_cannot_check(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--seconds", "1"]) == 2
    assert json.loads(capsys.readouterr().out) == {"error": "no CUDA device in this process"}


@pytest.mark.gpu
def test_on_a_gpu_without_mps_every_gemm_and_copy_is_right():
    assert wrong_gemms("cuda") == [] and wrong_copies("cuda") == []
