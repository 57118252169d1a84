"""The weight-sync bucket format: HF-named tensors packed into flat per-dtype buffers.

The actor trainer streams its weights to the rollout engines bucket by bucket (docs/design.md,
"The memory handoff", step 7). A bucket is a plain dict that crosses the wire as is:

    {"dtype": "bfloat16",                      # every tensor in the bucket has this dtype
     "names": ["model.embed_tokens.weight", ...],
     "shapes": [[151936, 2560], ...],
     "flat": <1-D tensor of that dtype>}       # the tensors' elements, concatenated in order

Transport: `push_weights` hands each bucket to a `send` callable; a bucket's buffer is
packed again only after every receiver acked it. The buffers live on the weights' device.
`send_to_engines` is the production sender (the actor's `sync_weights`): each bucket goes
to every engine at once, and `SYNC_NUM_BUFFERS` buffers per dtype keep two buckets in
flight (double buffering). `for_receiver` picks, per receiver, how `flat` travels: a CUDA
IPC handle when the receiver sees the same physical GPU (no copy through host memory),
else the bytes on the CPU (the runtime ships large ones through shared memory); `received`
undoes it.

Direct buckets (no packing copy). When every receiver sees the sender's physical GPU
(`send_to_engines`' test, as `for_receiver`'s), a tensor that is a window into a larger
storage (megatron's flat DDP parameter buffer: `is_window`) is not copied into a buffer.
Per dtype, such windows form one bucket, yielded after the packed ones:

    {"dtype": "bfloat16", "names": [...], "shapes": [...],      # HF shapes, as in a packed bucket
     "windows": [[storage_index, storage_offset, stride], ...],  # per tensor, in elements of dtype
     "storages": [<1-D uint8 tensor over a whole storage>, ...]} # each distinct storage once

A window's stride applies to its HF shape, or, where the window has another shape (a fourth
entry, `[storage_index, storage_offset, stride, size]`), to that size: a `LazyReshape`, whose
elements in row-major order are the HF tensor's (megatron's q/k/v at TP1: rows of q, k and
v interleave per query group in the fused parameter, so q_proj is the strided window
[groups, q rows per group, H], and no view has its HF shape).

`for_receiver` replaces each storage by one CUDA IPC handle (`cuda_ipc_storages`), so a
storage is shared once per bucket and receiver; the receiver maps each once (`received`),
`unpack_bucket` rebuilds the views (`as_strided` over the dtype view of the storage; a
`LazyReshape` where the window has its own size), the receiver copies them (`copy_into`)
through the same checks as a packed bucket's, synchronizes, drops the mappings and acks.
The ledger charges nothing for them (no buffer). Everything else (temporaries: casts, TP
gathers and the q/k/v regroup of one; tensors that own their storage; CPU tensors;
receivers on another GPU) goes through the packed buffers.

Contract for direct buckets: the sender must not write, free or resize its parameters
until every receiver acked (the actor's `sync_weights` waits for every ack before it
returns), and a receiver must drop every mapping before its ack. torch's producer-side IPC
ref counting (`reduce_tensor` wraps the storage's DataPtr in a counted one, count 1 per
share, minus 1 per mapping the receiver drops) then lets the sender free the storage at
once (megatron's offload: `untyped_storage().resize_(0)`): a mapping kept alive would park
the memory in torch's IPC limbo instead. A handle is mapped exactly once (two mappings of
one share would drive its count below zero), which is why each bucket carries its own
shares. After an offload/onload cycle the storage has a new address, and the next sync's
shares name it. Each share wraps the storage's DataPtr once more (a CUDA event and a
counter slot each, released when the storage is freed): a buffer never offloaded keeps one
per sync and engine.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable, Iterator

import torch

from roles.device import DeviceMemory
from roles.weight_views import LazyReshape, copy_into

NamedTensors = Iterable[tuple[str, torch.Tensor | LazyReshape]]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the wire spelling of a dtype."""
    return str(dtype).removeprefix("torch.")


def is_window(tensor: torch.Tensor) -> bool:
    """A view into a larger storage (megatron's parameter buffer), not a tensor that owns its
    whole storage (perhaps a temporary: a cast, the q/k/v regroup, a TP gather)."""
    return tensor.untyped_storage().nbytes() > tensor.nbytes


def pack_buckets(named_tensors: NamedTensors, buffer_bytes: int, *,
                 on_alloc: Callable[[int], None] | None = None, num_buffers: int = 1,
                 direct: Callable[[torch.device], bool] | None = None) -> Iterator[dict]:
    """Yield buckets of HF-named tensors, one dtype per bucket, each at most `buffer_bytes`.

    Tensors keep their input order within a dtype. `num_buffers` flat buffers of
    `buffer_bytes`, on the tensors' device, are allocated per dtype seen and REUSED in turn
    for the buckets of that dtype, so peak extra memory is `num_buffers * buffer_bytes` per
    dtype, not the model size. A tensor larger than `buffer_bytes` gets a bucket of its own
    whose `flat` is a view of that tensor (made contiguous if it is not already), so it
    costs no buffer.

    Reuse contract: a yielded bucket's `flat` stays valid until the generator has been
    resumed `num_buffers` times. With one buffer the caller sends the bucket, waits for
    every receiver's ack, and only then asks for the next bucket; with two it may ask for
    the next one first (double buffering) and must wait for this bucket's acks before the
    one after. `push_weights` does exactly this; receivers must copy what they keep
    (`unpack_bucket` returns views).

    A bucket's copies from windows into larger storages (megatron's parameter buffer; they
    may be strided views) run as one batched copy (`torch._foreach_copy_`) when it is sealed,
    so those inputs must stay unchanged until their bucket is yielded; a tensor that owns its
    whole storage (perhaps a temporary) is copied at once.

    `on_alloc(nbytes)` is called before each buffer is allocated, with the bytes of all
    buffers allocated so far (this one included): the sender accounts them (and a lease
    violation stops it before it allocates).

    `direct(device)`: True where the receivers can map the device's memory; a window
    (`is_window`) on such a device is then not packed but listed in its dtype's direct
    bucket (module docstring), yielded after every packed bucket; its storage must stay
    unchanged until that bucket is acked.

    A `LazyReshape` is a window of its view: packed, its view is copied into the buffer in
    HF row-major order; direct, the window names its own size. Buckets list HF shapes.
    """
    if not isinstance(buffer_bytes, int) or buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes={buffer_bytes!r} must be a positive int")
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"num_buffers={num_buffers!r} must be an int >= 1")
    open_buckets: dict[torch.dtype, _OpenBucket] = {}
    allocated = 0

    def allocate(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        nonlocal allocated
        numel = _buffer_elements(dtype, buffer_bytes)
        allocated += numel * dtype.itemsize
        if on_alloc is not None:
            on_alloc(allocated)
        return torch.empty(numel, dtype=dtype, device=device)

    windows: dict[torch.dtype, _DirectBucket] = {}
    for name, item in named_tensors:
        # what to read (a LazyReshape's view) and the HF shape it stands for
        tensor, shape = (item.view, item.shape) if isinstance(item, LazyReshape) else (item, item.shape)
        tensor = tensor.detach()
        if direct is not None and is_window(tensor) and direct(tensor.device):
            windows.setdefault(tensor.dtype, _DirectBucket(tensor.dtype)).add(name, tensor, shape)
            continue
        if tensor.numel() * tensor.element_size() > buffer_bytes:
            flat = tensor.reshape(-1).contiguous()
            yield _bucket(tensor.dtype, [name], [list(shape)], flat)
            continue
        bucket = open_buckets.get(tensor.dtype)
        if bucket is None:
            bucket = open_buckets[tensor.dtype] = _OpenBucket(
                tensor.dtype, num_buffers, lambda d=tensor.dtype, dev=tensor.device: allocate(d, dev))
        if not bucket.fits(tensor):
            yield bucket.seal()
            bucket.next_buffer()  # the caller has acked the bucket that used it: it may be overwritten now
        bucket.add(name, tensor, shape)
    for bucket in open_buckets.values():
        if bucket.names:
            yield bucket.seal()
    for window_bucket in windows.values():
        yield window_bucket.bucket()


def unpack_bucket(bucket: dict) -> list[tuple[str, torch.Tensor | LazyReshape]]:
    """(name, tensor) views into `bucket["flat"]` (a packed bucket) or into its `storages`
    (a direct bucket), in bucket order, each of its HF shape; a direct bucket's window of
    another size comes as a LazyReshape. The receiver copies them (`copy_into`)."""
    names, shapes = bucket["names"], bucket["shapes"]
    if len(names) != len(shapes):
        raise ValueError(f"bucket has {len(names)} names but {len(shapes)} shapes")
    if is_direct(bucket):
        return _unpack_windows(bucket)
    flat = bucket["flat"]
    if dtype_name(flat.dtype) != bucket["dtype"]:
        raise ValueError(f"bucket dtype {bucket['dtype']!r} but flat tensor is {dtype_name(flat.dtype)}")
    numels = [_numel(shape) for shape in shapes]
    if flat.dim() != 1 or flat.numel() != sum(numels):
        raise ValueError(
            f"bucket flat tensor has shape {list(flat.shape)}, expected 1-D with "
            f"{sum(numels)} elements for tensors {names}"
        )
    out, offset = [], 0
    for name, shape, numel in zip(names, shapes, numels):
        out.append((name, flat[offset : offset + numel].view(shape)))
        offset += numel
    return out


def is_direct(bucket: dict) -> bool:
    """A direct bucket (windows of the sender's storages), not a packed one."""
    return "windows" in bucket


def bucket_nbytes(bucket: dict) -> int:
    """The bytes of a bucket's tensors (either kind, before or after `for_receiver`)."""
    return sum(_numel(shape) for shape in bucket["shapes"]) * getattr(torch, bucket["dtype"]).itemsize


def bucket_device(bucket: dict) -> torch.device:
    """Where a received bucket's tensors live (the device the receiver copies from)."""
    storages = bucket.get("storages")
    return storages[0].device if storages else bucket["flat"].device


def _unpack_windows(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    names, shapes, windows, storages = bucket["names"], bucket["shapes"], bucket["windows"], bucket["storages"]
    dtype = getattr(torch, bucket["dtype"])
    if len(windows) != len(names):
        raise ValueError(f"direct bucket has {len(names)} names but {len(windows)} windows")
    typed = []
    for storage in storages:  # whole storages as uint8, viewed as the bucket's dtype
        if storage.dtype != torch.uint8 or storage.dim() != 1:
            raise ValueError(f"direct bucket storage is {list(storage.shape)} {dtype_name(storage.dtype)}, "
                             "expected 1-D uint8")
        typed.append(storage[: storage.numel() - storage.numel() % dtype.itemsize].view(dtype))
    out = []
    for name, shape, window in zip(names, shapes, windows):
        if len(window) not in (3, 4):
            raise ValueError(f"direct bucket tensor {name!r} has window {window}, expected "
                             "[storage_index, storage_offset, stride] or [..., size]")
        index, offset, stride, *size = window
        if not 0 <= index < len(typed):
            raise ValueError(f"direct bucket tensor {name!r} names storage {index} of {len(typed)}")
        # as_strided checks the window lies inside the storage
        view = typed[index].as_strided(size[0] if size else shape, stride, offset)
        out.append((name, LazyReshape(view, shape) if size else view))
    return out


SYNC_BUFFER_TAG = "weight_sync_buffer"
# Two buffers per dtype overlap packing the next bucket with the engines' copy of the last;
# a third would have nothing left to overlap (one packer, one copy) and only cost memory.
SYNC_NUM_BUFFERS = 2


def push_weights(named_tensors: NamedTensors, send: Callable[[dict], Any], buffer_bytes: int, *,
                 memory: DeviceMemory | None = None, num_buffers: int = 1,
                 direct: Callable[[torch.device], bool] | None = None) -> dict:
    """Pack `named_tensors` and call `send(bucket)` for each bucket; return totals.

    num_buffers=1: `send` must not return before every receiver has acked the bucket (e.g.
    it calls the engines' `update_weights` and waits on the futures): the next bucket
    reuses the buffer. num_buffers=2 (double buffering): `send` may return at once with a
    waitable (`.result()`, e.g. `BucketAcks`) that completes when every receiver acked;
    the next bucket is packed into the other buffer meanwhile, so at most `num_buffers`
    buckets are in flight: a bucket's waitable is waited for before its buffer is packed
    again (and before this returns), and the bucket is kept alive until then (a lone
    oversized tensor's `flat` may be a temporary). The first error a waitable raises ends
    the sync and is raised here; buckets still in flight are not waited for.
    `memory`: the sender's ledger, when the tensors live on its device (so the buffers do):
    the buffers allocated so far (up to `num_buffers * buffer_bytes` per dtype) are
    accounted under `SYNC_BUFFER_TAG` while they exist, and 0 once this returns or raises;
    the sender must hold its GPUs' lease for that (ppo.gpu.colocation's `sending_weights`).
    `direct`: as `pack_buckets`' (direct buckets cost no buffer); `direct_bytes` in the
    totals counts their bytes.
    """
    num_buckets = num_tensors = num_bytes = direct_bytes = 0
    on_alloc = None if memory is None else (lambda nbytes: memory.account(SYNC_BUFFER_TAG, nbytes))
    in_flight: list[tuple[dict, Any]] = []  # (bucket, what send returned), oldest first
    buckets = pack_buckets(named_tensors, buffer_bytes, on_alloc=on_alloc, num_buffers=num_buffers, direct=direct)
    try:
        for bucket in buckets:
            in_flight.append((bucket, send(bucket)))
            num_buckets += 1
            num_tensors += len(bucket["names"])
            num_bytes += bucket_nbytes(bucket)
            direct_bytes += bucket_nbytes(bucket) if is_direct(bucket) else 0
            while len(in_flight) >= num_buffers:  # the next bucket may reuse the oldest one's buffer
                _wait(in_flight.pop(0)[1])
        while in_flight:
            _wait(in_flight.pop(0)[1])
    finally:
        in_flight.clear()
        buckets.close()  # drops the buffers now, not when a traceback holding this frame goes
        if memory is not None:
            memory.account(SYNC_BUFFER_TAG, 0)
    return {"num_buckets": num_buckets, "num_tensors": num_tensors, "num_bytes": num_bytes,
            "direct_bytes": direct_bytes}


def _wait(acked: Any) -> None:
    """Wait for what `send` returned: a waitable (`.result()`), or nothing (it already waited)."""
    if acked is not None and hasattr(acked, "result"):
        acked.result()


class BucketAcks:
    """Every engine's ack of one bucket: `result()` waits on each future in turn (each up to
    `timeout_s`, as the single-buffer sync did) and raises the first error (RemoteError,
    ActorDied, CallTimeout), then calls `on_acked()`."""

    def __init__(self, futures: list, timeout_s: float, on_acked: Callable[[], None] | None = None):
        self.futures, self.timeout_s, self.on_acked = futures, timeout_s, on_acked

    def result(self) -> list:
        values = [future.result(self.timeout_s) for future in self.futures]
        if self.on_acked is not None:
            self.on_acked()
        return values


def send_to_engines(named_tensors: NamedTensors, engines: list, buffer_bytes: int, *,
                    engine_gpus: list[list[int] | None] | None = None, timeout_s: float = 600.0,
                    memory: DeviceMemory | None = None,
                    on_bucket: Callable[[dict, float], None] | None = None, direct: bool = True,
                    group=None, by_broadcast: list[bool] | None = None) -> dict:
    """Stream the tensors to every engine (`engine.update_weights.call(bucket)`, handles of
    roles.rollout.RolloutEngine or anything with that endpoint), double-buffered: return
    `push_weights`' totals once every engine acked every bucket.

    Each bucket goes to all engines at once; `SYNC_NUM_BUFFERS` buckets may be in flight, so
    the ledger (`memory`) charges up to that many buffers per dtype. `engine_gpus`: each
    engine's physical GPUs (CUDA IPC to those on the sender's GPU, `for_receiver`).
    `on_bucket(bucket, t0)`: called when a bucket's acks are in, with the wall time it was
    sent (the actor publishes a span; `bucket_nbytes` sizes either kind). An engine's error
    or a timeout is raised as is. `direct` (default): windows into larger storages travel
    as direct buckets (module docstring) when every engine sees the sender's physical GPU;
    with engines elsewhere, or direct=False, every tensor is packed.

    `by_broadcast[i]`: engine i is on another node and takes each bucket's tensor from
    `group`'s broadcast (roles.weight_broadcast), after a call that carries the rest of it.
    """
    gpus = engine_gpus or [None] * len(engines)
    if len(gpus) != len(engines):
        raise ValueError(f"engine_gpus has {len(gpus)} entries for {len(engines)} engines")
    remote = list(by_broadcast or [False] * len(engines))
    if len(remote) != len(engines) or (any(remote) and group is None):
        raise ValueError(f"by_broadcast={by_broadcast} for {len(engines)} engines needs one entry each, "
                         "and a weight group when any is True (join_weight_group)")
    gpus = [None if r else g for g, r in zip(gpus, remote)]  # another node's GPU ids mean nothing here

    @functools.cache  # asked for each of ~400 tensors, all on one device
    def all_engines_see(device: torch.device) -> bool:
        return bool(engines) and all(_sees(device, g) for g in gpus)

    def send(bucket: dict) -> BucketAcks:
        t0 = time.time()
        futures = [engine.update_weights.call(for_receiver(bucket, g))
                   for engine, g, r in zip(engines, gpus, remote) if not r]
        if any(remote):
            from roles.weight_broadcast import bucket_meta

            meta = bucket_meta(bucket)
            futures += [engine.receive_weights.call(meta) for engine, r in zip(engines, remote) if r]
            flat = bucket["flat"]
            group.broadcast(flat if flat.device == group.device() else flat.to(group.device()))
        return BucketAcks(futures, timeout_s, None if on_bucket is None else (lambda: on_bucket(bucket, t0)))

    return push_weights(named_tensors, send, buffer_bytes, memory=memory, num_buffers=SYNC_NUM_BUFFERS,
                        direct=all_engines_see if direct else None)


def _sees(device: torch.device, receiver_gpus: list[int] | None) -> bool:
    """Whether a receiver on `receiver_gpus` (physical ids) can map memory of `device`
    over CUDA IPC (the one place that decides it; the CPU tests stand in for it)."""
    from roles.cuda_ipc import physical_gpu

    return device.type == "cuda" and bool(receiver_gpus) and physical_gpu(device.index) in receiver_gpus


def for_receiver(bucket: dict, receiver_gpus: list[int] | None) -> dict:
    """The bucket as one receiver gets it: an IPC handle of a CUDA `flat` when the receiver
    is on the same physical GPU, else `flat` on the CPU. A direct bucket's storages become
    one IPC handle each (shared anew per receiver: each share is mapped once); it is only
    made for receivers on the sender's GPU."""
    from roles.cuda_ipc import share

    if is_direct(bucket):
        storages = bucket["storages"]
        if not all(_sees(s.device, receiver_gpus) for s in storages):
            raise ValueError(f"direct bucket for a receiver on GPUs {receiver_gpus}, which cannot map "
                             "the sender's device memory; pack instead (send_to_engines decides)")
        for device in {s.device for s in storages if s.is_cuda}:
            torch.cuda.current_stream(device).synchronize()  # the sender's last writes land first
        return {**{k: v for k, v in bucket.items() if k != "storages"},
                "cuda_ipc_storages": [share(s) for s in storages]}
    flat = bucket["flat"]
    if not flat.is_cuda:
        return bucket
    if _sees(flat.device, receiver_gpus):
        torch.cuda.current_stream(flat.device).synchronize()  # the packing copies must land first
        return {**{k: v for k, v in bucket.items() if k != "flat"}, "cuda_ipc": share(flat)}
    return {**bucket, "flat": flat.cpu()}


def received(bucket: dict) -> dict:
    """Undo `for_receiver`: map IPC handles back to tensors (views of the sender's memory,
    each storage mapped once). The receiver drops the result before it acks."""
    from roles.cuda_ipc import open_shared

    if "cuda_ipc_storages" in bucket:
        return {**{k: v for k, v in bucket.items() if k != "cuda_ipc_storages"},
                "storages": [open_shared(d) for d in bucket["cuda_ipc_storages"]]}
    if "cuda_ipc" not in bucket:
        return bucket
    return {**{k: v for k, v in bucket.items() if k != "cuda_ipc"}, "flat": open_shared(bucket["cuda_ipc"])}


class _OpenBucket:
    """The bucket being filled for one dtype, over `num_buffers` reusable flat buffers taken
    in turn; copies are queued and run together when the bucket is sealed."""

    def __init__(self, dtype: torch.dtype, num_buffers: int, allocate: Callable[[], torch.Tensor]):
        self.dtype = dtype
        self.buffers = [allocate()]
        self.num_buffers, self.allocate = num_buffers, allocate
        self.index = 0  # the buffer being filled
        self.buffer = self.buffers[0]
        self.names: list[str] = []
        self.shapes: list[list[int]] = []
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.used = 0  # elements filled

    def fits(self, tensor: torch.Tensor) -> bool:
        return self.used + tensor.numel() <= self.buffer.numel()

    def add(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
        """`tensor`'s elements, in row-major order, as the next tensor of HF `shape`."""
        dst = self.buffer[self.used : self.used + tensor.numel()].view(tensor.shape)
        if is_window(tensor):
            # a window into a larger, persistent storage (megatron's parameter buffer): batched at the seal
            self.dst.append(dst)
            self.src.append(tensor)
        else:
            # possibly a temporary (a cast, the q/k/v regroup, a TP gather): copied now, so up to
            # a bucket of such tensors is not kept alive on the device until the seal
            dst.copy_(tensor)
        self.names.append(name)
        self.shapes.append(list(shape))
        self.used += tensor.numel()

    def seal(self) -> dict:
        if self.dst:
            # batched copies per bucket: hundreds of tensors cost a few kernel launches, not one each
            copy_into(self.dst, self.src)
            self.dst, self.src = [], []
        return _bucket(self.dtype, self.names, self.shapes, self.buffer[: self.used])

    def next_buffer(self) -> None:
        """Start an empty bucket in the next buffer (allocated on first use)."""
        self.index = (self.index + 1) % self.num_buffers
        if self.index == len(self.buffers):
            self.buffers.append(self.allocate())
        self.buffer = self.buffers[self.index]
        self.names, self.shapes, self.used = [], [], 0


class _DirectBucket:
    """The windows of one dtype that travel unpacked: each distinct storage listed once."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.storages: list[torch.Tensor] = []
        self.index: dict[tuple, int] = {}  # (device, storage address) -> position in storages
        self.names: list[str] = []
        self.shapes: list[list[int]] = []
        self.windows: list[list] = []

    def add(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
        """The window `tensor` as the tensor of HF `shape` (its size named when it differs)."""
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key not in self.index:
            self.index[key] = len(self.storages)
            # a uint8 tensor over the whole storage: what one IPC handle describes
            self.storages.append(torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage))
        self.names.append(name)
        self.shapes.append(list(shape))
        window = [self.index[key], tensor.storage_offset(), list(tensor.stride())]
        self.windows.append(window if tensor.shape == shape else window + [list(tensor.shape)])

    def bucket(self) -> dict:
        return {"dtype": dtype_name(self.dtype), "names": self.names, "shapes": self.shapes,
                "windows": self.windows, "storages": self.storages}


def _bucket(dtype: torch.dtype, names: list[str], shapes: list[list[int]], flat: torch.Tensor) -> dict:
    return {"dtype": dtype_name(dtype), "names": names, "shapes": shapes, "flat": flat}


def _buffer_elements(dtype: torch.dtype, buffer_bytes: int) -> int:
    return buffer_bytes // dtype.itemsize


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel
