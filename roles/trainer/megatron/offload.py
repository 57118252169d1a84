"""Offload / onload of a megatron trainer's state by tag, through reused pinned CPU buffers.

Each tag names a list of device tensors (megatron's flat DDP buffers, the optimizer's
float32 main params and Adam moments). Offloading copies each distinct STORAGE behind them
into its own pinned CPU buffer (allocated once, reused at every later offload) and then
frees the device memory with `untyped_storage().resize_(0)`: every view into it (the
parameters are views into DDP's param buffer, `main_grad` into its grad buffer) stays valid
and sees the data again once onload resizes the storage and copies back. Tags with
`keep=False` (grads) are not copied: their content is meaningless between train calls, so
offload only frees them and onload zeroes them.

Host memory is the scarce side on one GPU (an offloaded Qwen3-4B trainer pins ~56 GB, and
the host may have 128 GiB for two trainers and an engine), so no pinned byte is held for
nothing:
- at each offload a tag's buffers are matched to its storages by size, so buffers of
  storages that still exist are reused and only new ones (Adam's moments, which appear at
  the first step) are pinned; a buffer no storage matches is freed;
- the tag's first offload is the one at construction (the trainer starts offloaded): its
  buffers are freed at the following onload. The state changes shape at the first step,
  and a tag that a one-GPU plan keeps resident (`--offload-train-level optimizer` keeps
  the weights) is never offloaded again. From the second offload on, a tag moves every
  iteration and keeps its buffers.
Freed pinned buffers go back to the OS (torch's pinned-host cache is emptied), not to a
cache that would keep them pinned.

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
        self._offloads: dict[str, int] = {}  # offloads of each tag so far
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
        self._offloads[tag] = self._offloads.get(tag, 0) + 1
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
        seconds = time.perf_counter() - start
        del pinned  # the buffers may be freed below
        self.offloaded.discard(tag)
        if self._offloads[tag] == 1 and self._pinned.pop(tag, None):  # the construction-time offload
            _empty_host_cache()
        return _report(moved, seconds)

    def _pinned_buffers(self, tag: str, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        """One buffer per storage: the tag's existing buffers reused by size, new ones pinned,
        unmatched ones freed."""
        pool = _by_size(self._pinned.pop(tag, []))
        pin = bool(storages) and storages[0].device.type == "cuda"
        bufs = [pool[st.nbytes()].pop() if pool.get(st.nbytes())
                else torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin) for st in storages]
        self._pinned[tag] = bufs
        if any(pool.values()):
            del pool
            _empty_host_cache()
        return bufs


def _by_size(buffers: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    pool: dict[int, list[torch.Tensor]] = {}
    for b in buffers:
        pool.setdefault(b.numel(), []).append(b)
    return pool


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if storages and storages[0].device.type == "cuda":
        torch.cuda.synchronize(storages[0].device)


def _empty_host_cache() -> None:
    """Return freed pinned blocks to the OS (torch keeps them cached, still pinned, otherwise)."""
    if not torch.cuda.is_available():
        return
    empty = (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
             or getattr(torch._C, "_host_emptyCache", None))
    if empty is not None:
        empty()


def _report(nbytes: int, seconds: float) -> dict:
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 and nbytes else 0.0}
