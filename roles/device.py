"""Where a role computes and how it accounts its device memory: real GPU, fake GPUs or CPU.

Roles call the same four methods everywhere and this module decides what they mean:

    mem = DeviceMemory("rollout-0")
    model.to(mem.device)
    mem.account("weights", nbytes_of(model))          # bytes this role now keeps under a tag
    model = mem.move(model, "cpu", tag="weights")     # offload: pinned CPU on a GPU, else bookkeeping
    mem.bytes_in_use()                                # what to report when giving up the lease

- fake GPUs (`runtime.fakegpu.visible_fake_devices()` non-empty; checked first, because
  the supervisor chose them explicitly): compute on the CPU; `account` writes the fake
  device ledger, which raises LeaseViolation / FakeOutOfMemory on a colocation bug.
- real GPU (`torch.cuda.is_available()`): compute on cuda:0 (the first GPU the supervisor
  made visible); `move` really offloads; `bytes_in_use` is what torch has allocated.
- neither: compute on the CPU; accounting is a local ledger only.

HostBlock is the page-locked host memory of offloads that outlive one move (a megatron
trainer's tagged state, the rollout engine's weights): exactly the bytes asked for.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Literal

import torch
from torch import nn

from roles.host_pages import advise_huge_pages, gpu_node, prefer_node
from runtime.fakegpu import FakeOutOfMemory, visible_fake_devices
from runtime.units import format_bytes

Movable = nn.Module | list[torch.Tensor]


CUDA_BLOCK = 512  # torch's CUDA caching allocator rounds every allocation up to this


def tenant_lifecycle(busy: str) -> dict[str, frozenset[str]]:
    """The state machine of a tenant of the memory handoff (a trainer, a reward model):

        starting -> offloaded <-> onloaded <-> BUSY

    built offloaded so that it starts while another role holds the GPU lease."""
    return {
        "starting": frozenset({"offloaded"}),
        "ready": frozenset({"offloaded"}),  # an in-process object starts "ready" (runtime.actor)
        "offloaded": frozenset({"onloaded"}),
        "onloaded": frozenset({"offloaded", busy}),
        busy: frozenset({"onloaded"}),
    }


def check_memory_tags(tags: list[str], allowed: tuple[str, ...]) -> None:
    """Refuse memory tags a role does not have, naming them and the allowed ones."""
    bad = [t for t in tags if t not in allowed]
    if bad:
        raise ValueError(f"memory tags {bad} unknown; allowed: {list(allowed)}")


def nbytes_of(obj: Movable, block: int = 1) -> int:
    """Bytes of a module's parameters and buffers, or of a list of tensors; shared storage
    counted once; each storage rounded up to a multiple of `block` (CUDA_BLOCK gives what
    `torch.cuda.memory_allocated` will count for them)."""
    tensors = list(obj.parameters()) + list(obj.buffers()) if isinstance(obj, nn.Module) else obj
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device.index or 0)
        if t.numel() and key not in seen:
            seen.add(key)
            total += -(-t.untyped_storage().nbytes() // block) * block
    return total


class DeviceMemory:
    """Device choice and memory ledger of one role process (`holder` is its ledger name).

    On fake GPUs, `account(tag, nbytes)` records `nbytes` on EVERY visible fake device: a
    role that spans several GPUs (tensor parallel, FSDP in one process) passes the bytes it
    keeps per GPU. Roles with one GPU, the usual case, see one device.
    """

    def __init__(self, holder: str):
        self.holder = holder
        self._fake = visible_fake_devices()
        if self._fake:
            self.kind: Literal["fake", "cuda", "cpu"] = "fake"
        elif torch.cuda.is_available():
            self.kind = "cuda"
        else:
            self.kind = "cpu"
        self.device = torch.device("cuda", 0) if self.kind == "cuda" else torch.device("cpu")
        self._ledger: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"DeviceMemory({self.holder!r}, kind={self.kind!r}, ledger={self._ledger})"

    def account(self, tag: str, nbytes: int) -> None:
        """Set the bytes this role keeps on its device(s) under `tag` (absolute, not a delta).

        On fake GPUs a failed update (lease not held, capacity exceeded) raises and leaves
        every device and the local ledger as they were.
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0 (tag {tag!r})")
        old = self._ledger.get(tag, 0)
        done = []
        try:
            for dev in self._fake:
                dev.set_usage(self.holder, tag, nbytes)
                done.append(dev)
        except BaseException:
            for dev in done:  # restoring the old value; allowed because it shrinks what we grew
                dev.set_usage(self.holder, tag, old)
            raise
        if nbytes:
            self._ledger[tag] = nbytes
        else:
            self._ledger.pop(tag, None)

    @contextlib.contextmanager
    def transient(self, tag: str, nbytes: int, *, phase: str) -> Iterator[None]:
        """Account `nbytes` under `tag` while the block runs: memory held only during a
        phase (a micro-batch's activations and logits), charged so that a plan that would
        not fit the real device fails on the fake one. Out of memory there is a
        FakeOutOfMemory naming this role, the phase and the bytes."""
        try:
            self.account(tag, nbytes)
        except FakeOutOfMemory as e:
            raise FakeOutOfMemory(f"{self.holder} ran out of fake GPU memory in phase {phase!r} "
                                  f"({tag}: {format_bytes(nbytes)}): {e}") from None
        try:
            yield
        finally:
            self.account(tag, 0)

    def ledger(self) -> dict[str, int]:
        """Bytes per tag as last accounted (per device)."""
        return dict(self._ledger)

    def capacity_bytes(self) -> int | None:
        """Memory of one of this role's devices; None on the CPU, which has no fixed budget."""
        if self.kind == "cuda":
            return torch.cuda.get_device_properties(0).total_memory
        if self.kind == "fake":
            return self._fake[0].capacity
        return None

    def bytes_in_use(self) -> int:
        """Device bytes this role holds: torch's allocation on a real GPU (after dropping
        torch's caches), the ledger on fake GPUs (per device), 0 on the CPU."""
        if self.kind == "cuda":
            # cuBLAS keeps its workspace (32 MiB on Hopper) in torch's allocator: it is cache, not
            # state, and cuBLAS makes a new one at the next matmul. Free it, or every lease
            # handoff would report it as memory the role forgot to offload.
            torch.cuda.synchronize()
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:
                clear()
            torch.cuda.empty_cache()
            return sum(torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count()))
        if self.kind == "fake":
            return sum(self._ledger.values())
        return 0

    def move(self, obj: Movable, where: Literal["device", "cpu"], *, tag: str) -> Movable:
        """Onload (`where="device"`) or offload (`"cpu"`) a module or tensors; account `tag`.

        Real GPU: tensors go to pinned CPU memory and back, and the freed cache is returned
        to the driver so the next lease holder can use it. Fake GPUs and CPU: nothing moves
        (everything already lives on the CPU); only the accounting changes. Returns the
        moved object: the same module, or a new list of tensors.
        """
        if where not in ("device", "cpu"):
            raise ValueError(f"where={where!r} must be 'device' or 'cpu'")
        nbytes = nbytes_of(obj, CUDA_BLOCK if self.kind == "cuda" else 1)
        if where == "device":
            self.account(tag, nbytes)  # account first: a lease violation must not allocate
            if self.kind == "cuda":
                obj = _to(obj, lambda t: t.to(self.device, non_blocking=True))
            return obj
        if self.kind == "cuda":
            obj = _to(obj, _pinned_copy)
            torch.cuda.synchronize()  # pinned copies are async; finish before the GPU memory is reused
            torch.cuda.empty_cache()
        self.account(tag, 0)
        return obj


class HostBlock:
    """CPU memory of exactly sum(sizes) bytes, split into one uint8 view per size; page-locked
    in place (cudaHostRegister) when `pin`, so copies to and from a GPU run asynchronously at
    the pinned rate, without torch's pinned allocator, which rounds every block up to a power
    of two (7.5 GiB of engine weights pin 8 GiB) and keeps what is freed pinned in its cache.

    touch (when pinning): fault the pages in from TOUCH_THREADS threads of our own before
    registering; cudaHostRegister alone faults them on one kernel thread: 8 GiB took 4.29 s
    that way and 0.92 s touched first from torch's 16 threads on the H200 host
    (bench.host_pinning, the one caller that turns it off). Our own threads, not torch's
    intra-op pool: role processes run with OMP_NUM_THREADS=1 (ppo.setup.job), where zero_() is one
    thread again.

    place_pages (when pinning): before any page is touched, prefer the NUMA node of the
    current GPU (roles.host_pages): on a host of several nodes, a block made while others fill
    that node would otherwise land on the far one and its copies cross the socket link; and
    ask for transparent huge pages. Not measured on a multi-node host (the lent H200's has
    one node; bench.host_pinning compares the placements).

    The owner keeps the block while the views are in use: dropping it (free() or garbage
    collection) unregisters the pages.
    """

    def __init__(self, sizes: list[int], *, pin: bool, touch: bool = True, place_pages: bool = True):
        self.sizes, self.nbytes = sizes, sum(sizes)
        self._flat = torch.empty(self.nbytes, dtype=torch.uint8)
        pin = pin and self.nbytes > 0
        if pin and place_pages:
            node = gpu_node(torch.cuda.current_device())
            if node is not None:
                prefer_node(self._flat, node)
            advise_huge_pages(self._flat)
        if pin and touch:
            touch_pages(self._flat)
        self.views = list(self._flat.split(sizes)) if sizes else []
        self._unpin = None
        if pin:
            _check(torch.cuda.cudart().cudaHostRegister(self._flat.data_ptr(), self.nbytes, 0))
            # a block dropped without free() (its owner torn down) must not leave its pages
            # locked, nor a stale registration that a later block at the same address would hit
            self._unpin = weakref.finalize(self, _unregister, self._flat)
            self._unpin.atexit = False  # the process's exit releases everything anyway

    def free(self) -> None:
        """Unregister and drop the memory (the views must not be used after)."""
        if self._unpin is not None and self._unpin.alive:
            _check(self._unpin())
        self.views, self._flat = [], torch.empty(0, dtype=torch.uint8)


# Whether host_to_device copies through SMs (True) or a copy engine.
SM_COPIES = True


def host_to_device(dst: torch.Tensor, src: torch.Tensor, through_sms: bool | None = None) -> None:
    """dst.copy_(src) for a contiguous uint8 device tensor and a page-locked host view of the
    same size, asynchronous on the current stream; on a GPU done by SMs, not a copy engine.

    Why: right after device memory is returned to the driver, by this process or another,
    copy-engine copies to the device run at half the pinned rate for a while (on the H200:
    27.5 GB/s for a whole 8 GB copy after another process freed 64 GB; the first ~2.5 GB
    after this process freed 72 GB), which is exactly when a colocated trainer onloads. An
    elementwise kernel reading the page-locked pages through their device mapping (CUDA's
    unified addressing maps registered host memory) is not slowed: 49.1-49.5 GB/s (0.89x
    pinned) by torch's bitwise_or in every case measured, where the copy engine gives 27.5-55
    GB/s; roles.sm_copy's Triton kernel reads faster (50.9 GB/s in the same probe). Splitting a
    copy between the two is worse than either (36 GB/s at half and half after a free:
    docs/journal/, "the half-rate onload"). None: SM_COPIES. On the CPU, a plain copy."""
    through_sms = SM_COPIES if through_sms is None else through_sms
    mapped = _device_view(src) if dst.is_cuda and through_sms and src.numel() else None
    if mapped is None:
        dst.copy_(src, non_blocking=True)
    elif dst.data_ptr() % 4 == 0 and mapped.data_ptr() % 4 == 0 and dst.numel() % 4 == 0:
        copy_words = _sm_copy_kernel()
        if copy_words is not None:  # Triton's: 0.924x pinned where int32 bitwise_or reads 0.907x
            copy_words(dst.view(torch.int32), mapped.view(torch.int32))
        else:
            torch.bitwise_or(mapped.view(torch.int32), 0, out=dst.view(torch.int32))
    else:  # byte-wise: the same copy, more instructions
        torch.bitwise_or(mapped, 0, out=dst)


@functools.cache
def _sm_copy_kernel():
    """roles.sm_copy.copy_words, or None without Triton."""
    try:
        from roles.sm_copy import copy_words
    except ImportError:
        return None
    return copy_words


class _CudaArray:
    """A raw device address as `__cuda_array_interface__`, for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _device_view(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA uint8 tensor over the same page-locked host bytes (unified addressing: the
    device address of registered memory is its host address); None where the driver
    refuses it (memory not registered)."""
    try:
        return torch.as_tensor(_CudaArray(host.data_ptr(), host.numel()), device="cuda")
    except (RuntimeError, TypeError, ValueError):
        return None


TOUCH_THREADS = min(16, os.cpu_count() or 1)


def touch_pages(flat: torch.Tensor, threads: int = TOUCH_THREADS) -> None:
    """Zero `flat` in `threads` slices at once (zero_ releases the GIL), faulting its pages in
    in parallel whatever torch's own thread count."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(torch.Tensor.zero_, flat.chunk(threads)))


def _unregister(flat: torch.Tensor) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(flat.data_ptr()))


def _check(result) -> None:
    if int(result) != 0:
        raise RuntimeError(f"CUDA host (un)registration failed: cudaError {int(result)}")


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _to(obj: Movable, convert) -> Movable:
    if not isinstance(obj, nn.Module):
        return [convert(t) for t in obj]
    done: set[int] = set()  # tied parameters are one object visited twice
    for module in obj.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in done:
                done.add(id(param))
                param.data = convert(param.data)
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = convert(buf)
    return obj
