"""roles.device.HostBlock's page-locking on a GPU (`bash .ci/gpu -k host_block`): needs CUDA only.

A block registered with cudaHostRegister, its pages touched first (the default) or not,
reports pinned and copies both ways; free() and a block dropped without free() both
unregister it (a trainer torn down must not leave its pages locked, nor a stale registration
that a later block at the same address would hit). host_to_device copies out of a block, by SMs
or a copy engine, bit for bit, at any size and alignment.
"""

from __future__ import annotations

import gc

import pytest
import torch

import roles.device
from roles.device import HostBlock, host_to_device

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("touch", [True, False])
def test_host_block_pins_copies_and_unpins_when_freed_or_dropped(touch):
    sizes = [3 << 20, 5 << 20, 1 << 10]
    block = HostBlock(sizes, pin=True, touch=touch)
    flat = block._flat
    assert flat.is_pinned() and flat.numel() == sum(sizes) and [v.numel() for v in block.views] == sizes
    src = torch.randint(0, 256, (sizes[1],), dtype=torch.uint8, device="cuda")
    block.views[1].copy_(src, non_blocking=True)
    back = torch.empty_like(src).copy_(block.views[1], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    block.free()
    assert not flat.is_pinned() and block.views == []
    block.free()  # twice is harmless

    dropped = HostBlock(sizes, pin=True, touch=touch)
    kept = dropped._flat
    assert kept.is_pinned()
    del dropped
    gc.collect()
    assert not kept.is_pinned()
    again = HostBlock(sizes, pin=True, touch=touch)  # registering the same pages again must not fail
    assert again._flat.is_pinned()
    again.free()


@pytest.mark.parametrize("path", ["copy_engine", "sm_triton", "sm_bitwise_or"])
def test_host_to_device_is_bitwise_at_any_size_and_alignment(path, monkeypatch):
    if path == "sm_bitwise_or":  # the SM copy where Triton is missing
        monkeypatch.setattr(roles.device, "_sm_copy_kernel", lambda: None)
    sizes = [(1 << 20) + 3, 5, (3 << 20) + 8, 4 << 20]  # odd sizes put later views off 4-byte alignment
    block = HostBlock(sizes, pin=True)
    for view in block.views:  # the last two are 4-byte aligned and sized (the word copy), with a partial last program
        view.copy_(torch.randint(0, 256, (view.numel(),), dtype=torch.uint8))
        for offset in (0, 1):  # an aligned destination and an unaligned one
            dst = torch.empty(view.numel() + offset, dtype=torch.uint8, device="cuda")[offset:]
            host_to_device(dst, view, path != "copy_engine")
            torch.cuda.synchronize()
            assert torch.equal(dst.cpu(), view)
    block.free()
