"""roles.gemm_check: the bf16 GEMM check run in an MPS client at each side-by-side SM share
(ppo.side_by_side.check_shares). Its verdict on the CPU, on a linear that leaves an output
unwritten, and (`bash .ci/gpu -k gemm_check`) on the GPU without MPS."""

import pytest
import torch
import torch.nn.functional as F

from roles.gemm_check import SHAPES, main, unwritten_gemms


def test_a_right_linear_passes_every_shape():
    assert unwritten_gemms("cpu") == []


def test_an_output_left_unwritten_or_wrong_is_named_by_its_shape():
    """As cuBLAS did under MPS at 75% on the H200: the output block returned untouched (NaN)."""
    unwritten, wrong = SHAPES[0], SHAPES[3]

    def linear(x, w):
        m, k, n = x.shape[0], x.shape[1], w.shape[0]
        if (m, k, n) == unwritten:
            return torch.full((m, n), float("nan"), dtype=x.dtype)
        y = F.linear(x, w)
        return y * 1.1 if (m, k, n) == wrong else y

    assert unwritten_gemms("cpu", linear) == [unwritten, wrong]


def test_without_cuda_the_module_says_it_cannot_check(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main() == 2
    assert '"no CUDA device in this process"' in capsys.readouterr().out


@pytest.mark.gpu
def test_on_a_gpu_without_mps_every_gemm_is_written():
    assert unwritten_gemms("cuda") == []
