"""Offload / onload of a megatron trainer's state by tag, through page-locked host blocks.

Each tag names a list of device tensors (megatron's flat DDP buffers, the optimizer's
float32 main params and Adam moments). Offloading copies each distinct STORAGE behind them
into its own slice of the tag's host block and then frees the device memory with
`untyped_storage().resize_(0)`: every view into it (the parameters are views into DDP's
param buffer, `main_grad` into its grad buffer) stays valid and sees the data again once
onload resizes the storage and copies back. Tags with `keep=False` (grads) are not copied:
their content is meaningless between train calls, so offload only frees them and onload
zeroes them.

Host memory is the scarce side on one GPU (an offloaded Qwen3-4B trainer pins ~56 GB, and
the host may have 128 GiB for two trainers and an engine), so no pinned byte is held for
nothing:
- a tag's host copy is ONE roles.device.HostBlock of exactly its bytes: torch's pinned
  allocator rounds every block up to a power of two (a Qwen3-4B optimizer's 1,200 storages
  would pin ~1.33x their 45 GiB) and caches what is freed, still pinned;
- the block is reused while the tag's storages keep their sizes, and replaced (the old one
  unregistered and freed) when they change, as when Adam's moments appear;
- the tag's first offload is the one at construction (the trainer starts offloaded): its
  block is freed at the following onload. The state changes shape at the first step, and
  a tag that a one-GPU plan keeps resident (`--offload-train-level optimizer` keeps the
  weights) is never offloaded again. From the second offload on, a tag moves every
  iteration and keeps its block;
- except a tag registered with `keep_first`: one whose sizes never change (the params) and
  that the run offloads every iteration keeps its construction-time block, which spares the
  ~2 s that making a later block took (3.8 GB/s at the first full offload).

Onloads copy through roles.device.host_to_device, by SMs rather than a copy engine: copy-engine
copies right after a large free (by this or another process) run at half rate.

Every move reports bytes and GB/s per tag; accounting goes through roles.device.DeviceMemory
(account before allocating on onload, after freeing on offload) so the lease checks hold.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from roles.device import DeviceMemory, HostBlock, host_to_device


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
        self._keep_first: dict[str, bool] = {}
        self._freed: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}
        self._host: dict[str, HostBlock] = {}
        self._offloads: dict[str, int] = {}  # offloads of each tag so far
        self.offloaded: set[str] = set()

    def register(self, tag: str, tensors: Callable[[], list[torch.Tensor]], *, keep: bool = True,
                 keep_first: bool = False) -> None:
        """`tensors()` lists the tag's device tensors (called at each offload: an optimizer's
        state appears at its first step). keep=False: the content is not kept across offload.
        keep_first: the construction-time host block is kept (module note)."""
        self._tensors[tag] = tensors
        self._keep[tag] = keep
        self._keep_first[tag] = keep_first

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
            for st, buf in zip(storages, self._host_views(tag, storages)):
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
            return {**_report(0, 0.0), "alloc_seconds": 0.0}
        freed = self._freed.pop(tag)
        self.memory.account(tag, sum(n for _, n in freed))  # before allocating: a lease violation raises here
        start = time.perf_counter()
        moved, alloc_s = 0, 0.0
        views = self._host[tag].views if self._keep[tag] else []
        for i, (st, nbytes) in enumerate(freed):
            t0 = time.perf_counter()
            st.resize_(nbytes)
            alloc_s += time.perf_counter() - t0  # the allocator's share (cudaMalloc when its cache is empty)
            if self._keep[tag]:
                host_to_device(_as_bytes(st), views[i])
                moved += nbytes
            else:
                _as_bytes(st).zero_()
        _synchronize([st for st, _ in freed])
        seconds = time.perf_counter() - start
        del views
        self.offloaded.discard(tag)
        if self._offloads[tag] == 1 and tag in self._host and not self._keep_first[tag]:  # the construction-time one
            self._host.pop(tag).free()
        return {**_report(moved, seconds), "alloc_seconds": alloc_s}

    def untracked_blocks(self) -> list[int]:
        """Sizes, largest first, of the live allocations on this process's GPU that are none of
        the resident tags' storages (CUDA only): what the lease check names when a role keeps
        more than its ledger says."""
        if not torch.cuda.is_available():
            return []
        tagged = {st.data_ptr() for tag, tensors in self._tensors.items() if tag not in self.offloaded
                  for st in _storages(tensors())}
        return sorted((b["size"] for seg in torch.cuda.memory_snapshot() for b in seg["blocks"]
                       if b["state"] == "active_allocated" and b["address"] not in tagged), reverse=True)

    def _host_views(self, tag: str, storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
        """One view per storage into the tag's host block, which is replaced when the sizes change."""
        sizes = [st.nbytes() for st in storages]
        block = self._host.get(tag)
        if block is None or block.sizes != sizes:
            if block is not None:
                self._host.pop(tag).free()
            block = self._host[tag] = HostBlock(sizes, pin=bool(storages) and storages[0].device.type == "cuda")
        return block.views


def _synchronize(storages: list[torch.UntypedStorage]) -> None:
    if storages and storages[0].device.type == "cuda":
        torch.cuda.synchronize(storages[0].device)


def _report(nbytes: int, seconds: float) -> dict:
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 and nbytes else 0.0}
