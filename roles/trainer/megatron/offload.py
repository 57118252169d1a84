"""Offload / onload of a megatron trainer's state by tag, through reused pinned CPU buffers.

Each tag names a list of device tensors (megatron's flat DDP buffers, the optimizer's
float32 main params and Adam moments). Offloading copies each distinct STORAGE behind them
into its own pinned CPU buffer (allocated once, reused at every later offload) and then
frees the device memory with `untyped_storage().resize_(0)`: every view into it (the
parameters are views into DDP's param buffer, `main_grad` into its grad buffer) stays valid
and sees the data again once onload resizes the storage and copies back. Tags with
`keep=False` (grads) are not copied: their content is meaningless between train calls, so
offload only frees them and onload zeroes them.

Every move reports bytes and GB/s per tag; accounting goes through roles.device.DeviceMemory
(account before allocating on onload, after freeing on offload) so the lease checks hold.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from roles.device import DeviceMemory


def _storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            out.append(st)
    return out


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class TaggedOffloader:
    """Device tensors by tag, each tag on the device or offloaded."""

    def __init__(self, memory: DeviceMemory):
        self.memory = memory
        self._tensors: dict[str, Callable[[], list[torch.Tensor]]] = {}
        self._keep: dict[str, bool] = {}
        self._freed: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self._pinned: dict[str, list[torch.Tensor]] = {}
        self.offloaded: set[str] = set()

    def register(self, tag: str, tensors: Callable[[], list[torch.Tensor]], *, keep: bool = True) -> None:
        """`tensors()` lists the tag's device tensors (called at each offload: an optimizer's
        state appears at its first step). keep=False: the content is not kept across offload."""
        self._tensors[tag] = tensors
        self._keep[tag] = keep

    def nbytes(self, tag: str) -> int:
        """Device bytes of the tag's storages (the last offloaded size while offloaded)."""
        if tag in self.offloaded:
            return sum(n for _, n in self._freed[tag])
        return sum(st.nbytes() for st in _storages(self._tensors[tag]()))

    def offload(self, tag: str) -> dict:
        if tag in self.offloaded:
            return _report(0, 0.0)
        storages = _storages(self._tensors[tag]())
        start = time.perf_counter()
        moved = 0
        if self._keep[tag]:
            pinned = self._pinned_buffers(tag, storages)
            for st, buf in zip(storages, pinned):
                buf.copy_(_as_bytes(st), non_blocking=True)
                moved += st.nbytes()
        _synchronize(storages)
        seconds = time.perf_counter() - start
        self._freed[tag] = [(st, st.nbytes()) for st in storages]
        for st in storages:
            st.resize_(0)
        self.offloaded.add(tag)
        self.memory.account(tag, 0)
        return _report(moved, seconds)

    def onload(self, tag: str) -> dict:
        if tag not in self.offloaded:
            return _report(0, 0.0)
        freed = self._freed.pop(tag)
        self.memory.account(tag, sum(n for _, n in freed))  # before allocating: a lease violation raises here
        start = time.perf_counter()
        moved = 0
        pinned = self._pinned.get(tag, [])
        for i, (st, nbytes) in enumerate(freed):
            st.resize_(nbytes)
            if self._keep[tag]:
                _as_bytes(st).copy_(pinned[i], non_blocking=True)
                moved += nbytes
            else:
                _as_bytes(st).zero_()
        _synchronize([st for st, _ in freed])
        self.offloaded.discard(tag)
        return _report(moved, time.perf_counter() - start)

    def _pinned_buffers(self, tag: str, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        bufs = self._pinned.get(tag, [])
        if [b.numel() for b in bufs] != [st.nbytes() for st in storages]:
            pin = bool(storages) and storages[0].device.type == "cuda"
            bufs = [torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin) for st in storages]
            self._pinned[tag] = bufs
        return bufs


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if storages and storages[0].device.type == "cuda":
        torch.cuda.synchronize(storages[0].device)


def _report(nbytes: int, seconds: float) -> dict:
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 and nbytes else 0.0}
