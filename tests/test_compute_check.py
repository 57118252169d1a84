"""roles.compute_check: the check run in each role's MPS client side by side
(ppo.gpu.side_by_side.check_roles). Its verdict on the CPU, on a matmul that leaves an output
unwritten or wrong and a copy that writes nothing, and (`bash .ci/gpu -k compute_check`) on the
GPU without MPS."""

import json

import pytest
import torch

import roles.compute_check as cc
from roles.compute_check import COPY_SIZES, LAYOUTS, SHAPES, check, check_in_run, main, wrong_copies, wrong_gemms

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


def test_the_check_repeats_for_its_seconds_and_counts_every_check(monkeypatch):
    clock = iter([0.0, 0.1, 0.2, 0.35])  # the start, then after each round
    monkeypatch.setattr(cc, "monotonic", lambda: next(clock))
    report = check("cpu", seconds=0.3, shapes=SMALL[:1])
    assert report["rounds"] == 3 and report["wrong"] == [] and report["copy"] == []
    assert report["checked"] == 3 + len(COPY_SIZES)  # three layouts of one shape, and the copies


def test_without_cuda_the_module_says_it_cannot_check(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--seconds", "1"]) == 2
    assert json.loads(capsys.readouterr().out) == {"error": "no CUDA device in this process"}


def test_in_run_the_check_stops_a_role_under_mps_whose_gemms_come_out_wrong(monkeypatch):
    def unwritten(a, b):
        return torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=a.dtype)

    monkeypatch.delenv(cc.MPS_SHARE_ENV, raising=False)
    check_in_run("actor", "cpu", unwritten)  # not an MPS client: nothing checked
    monkeypatch.setenv(cc.MPS_SHARE_ENV, "75")
    monkeypatch.setattr(cc, "under_mps", lambda: True)  # as on a GPU
    check_in_run("actor", "cpu")  # right GEMMs pass
    with pytest.raises(cc.ComputeWrong) as e:
        check_in_run("rollout engine 0", "cpu", unwritten)
    assert str(e.value).startswith("rollout engine 0: in its MPS client (75% of the SMs) 9 of 9 bf16 GEMMs came out "
                                   "wrong (the first: the forward GEMM of a linear of 134 x 64 -> 256; "
                                   "roles.compute_check), though the launch check passed")


@pytest.mark.gpu
def test_on_a_gpu_without_mps_every_gemm_and_copy_is_right():
    assert wrong_gemms("cuda") == [] and wrong_copies("cuda") == []
