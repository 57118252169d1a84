"""The weight-sync bucket format: HF-named tensors packed into flat per-dtype buffers.

The actor trainer streams its weights to the rollout engines bucket by bucket (DESIGN.md,
"Colocation", step 7). A bucket is a plain dict that crosses the wire as is:

    {"dtype": "bfloat16",                      # every tensor in the bucket has this dtype
     "names": ["model.embed_tokens.weight", ...],
     "shapes": [[151936, 2560], ...],
     "flat": <1-D tensor of that dtype>}       # the tensors' elements, concatenated in order

Transport: `push_weights` hands each bucket to a `send` callable and blocks until it
returns, i.e. until every receiver acked. The buffers live on the weights' device.
`for_receiver` picks, per receiver, how `flat` travels: a CUDA IPC handle when the
receiver sees the same physical GPU (no copy through host memory), else the bytes on the
CPU (the runtime ships large ones through shared memory); `received` undoes it.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Iterable, Iterator

import torch

from roles.device import DeviceMemory

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the wire spelling of a dtype."""
    return str(dtype).removeprefix("torch.")


def pack_buckets(named_tensors: NamedTensors, buffer_bytes: int, *,
                 on_alloc: Callable[[int], None] | None = None) -> Iterator[dict]:
    """Yield buckets of HF-named tensors, one dtype per bucket, each at most `buffer_bytes`.

    Tensors keep their input order within a dtype. One flat buffer of `buffer_bytes`, on
    the tensors' device, is allocated per dtype seen and REUSED for every bucket of that
    dtype, so peak extra memory is `buffer_bytes` per dtype, not the model size. A tensor
    larger than `buffer_bytes` gets a bucket of its own whose `flat` is a view of that
    tensor (made contiguous if it is not already), so it costs no buffer.

    Reuse contract: a yielded bucket's `flat` stays valid only until the generator is
    resumed. The caller sends the bucket, waits for every receiver's ack, and only then
    asks for the next bucket, which may overwrite the same buffer. `push_weights` does
    exactly this; receivers must copy what they keep (`unpack_bucket` returns views).

    `on_alloc(nbytes)` is called before each buffer is allocated, with the bytes of all
    buffers allocated so far (this one included): the sender accounts them (and a lease
    violation stops it before it allocates).
    """
    if not isinstance(buffer_bytes, int) or buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes={buffer_bytes!r} must be a positive int")
    open_buckets: dict[torch.dtype, _OpenBucket] = {}
    allocated = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if tensor.numel() * tensor.element_size() > buffer_bytes:
            flat = tensor.reshape(-1).contiguous()
            yield _bucket(tensor.dtype, [name], [list(tensor.shape)], flat)
            continue
        bucket = open_buckets.get(tensor.dtype)
        if bucket is None:
            allocated += _buffer_elements(tensor.dtype, buffer_bytes) * tensor.element_size()
            if on_alloc is not None:
                on_alloc(allocated)
            bucket = open_buckets[tensor.dtype] = _OpenBucket(tensor.dtype, buffer_bytes, tensor.device)
        if not bucket.fits(tensor):
            yield bucket.seal()
            bucket.clear()  # the caller has acked: the buffer may be overwritten now
        bucket.add(name, tensor)
    for bucket in open_buckets.values():
        if bucket.names:
            yield bucket.seal()


def unpack_bucket(bucket: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `bucket["flat"]`, in bucket order; the receiver copies them."""
    flat, names, shapes = bucket["flat"], bucket["names"], bucket["shapes"]
    if len(names) != len(shapes):
        raise ValueError(f"bucket has {len(names)} names but {len(shapes)} shapes")
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


SYNC_BUFFER_TAG = "weight_sync_buffer"


def push_weights(named_tensors: NamedTensors, send: Callable[[dict], Any], buffer_bytes: int, *,
                 memory: DeviceMemory | None = None) -> dict:
    """Pack `named_tensors` and call `send(bucket)` for each bucket; return totals.

    `send` must not return before every receiver has acked the bucket (e.g. it calls the
    engines' `update_weights` and waits on the futures): the next bucket reuses the buffer.
    `memory`: the sender's ledger, when the tensors live on its device (so the buffers do):
    the buffers are accounted under `SYNC_BUFFER_TAG` while they exist; the sender must hold
    its GPUs' lease for that (ppo.colocation's `sending_weights`).
    """
    num_buckets = num_tensors = num_bytes = 0
    on_alloc = None if memory is None else (lambda nbytes: memory.account(SYNC_BUFFER_TAG, nbytes))
    try:
        for bucket in pack_buckets(named_tensors, buffer_bytes, on_alloc=on_alloc):
            send(bucket)
            num_buckets += 1
            num_tensors += len(bucket["names"])
            num_bytes += bucket["flat"].numel() * bucket["flat"].element_size()
    finally:
        if memory is not None:
            memory.account(SYNC_BUFFER_TAG, 0)  # the generator is done: its buffers are garbage
    return {"num_buckets": num_buckets, "num_tensors": num_tensors, "num_bytes": num_bytes}


def for_receiver(bucket: dict, receiver_gpus: list[int] | None) -> dict:
    """The bucket as one receiver gets it: an IPC handle of a CUDA `flat` when the receiver
    is on the same physical GPU, else `flat` on the CPU."""
    flat = bucket["flat"]
    if not flat.is_cuda:
        return bucket
    from roles.cuda_ipc import physical_gpu, share

    if receiver_gpus and physical_gpu(flat.device.index) in receiver_gpus:
        torch.cuda.current_stream(flat.device).synchronize()  # the packing copies must land first
        return {**{k: v for k, v in bucket.items() if k != "flat"}, "cuda_ipc": share(flat)}
    return {**bucket, "flat": flat.cpu()}


def received(bucket: dict) -> dict:
    """Undo `for_receiver`: map an IPC handle back to a tensor (a view of the sender's buffer)."""
    if "cuda_ipc" not in bucket:
        return bucket
    from roles.cuda_ipc import open_shared

    return {**{k: v for k, v in bucket.items() if k != "cuda_ipc"}, "flat": open_shared(bucket["cuda_ipc"])}


# HF's tied-weight convention (`_tied_weights_keys` of the *ForCausalLM classes): the output
# projection aliases the input embedding, and a checkpoint stores the embedding's name only.
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}


def canonical_named_tensors(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as an HF checkpoint stores them: every tied alias dropped.

    Two listings of one model differ in how they show tied weights: `named_parameters()`
    lists a shared parameter once, `state_dict()` under every name (Qwen3-4B's
    `lm_head.weight` is `model.embed_tokens.weight`). Memory listed under several names is
    kept once, under its first name, except that a tied alias (`TIED_ALIASES`) yields to the
    name HF stores, as `save_pretrained` does. An alias that is a separate but bit-identical
    copy of its target (a backend that copies tied weights) is dropped too; an untied
    `lm_head.weight` that differs from the embedding is an ordinary tensor, and a listing
    with the alias alone keeps it.
    """
    seen: dict[tuple, str] = {}  # memory identity -> the name it is kept under
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        key = _memory_identity(tensor) if tensor.numel() else ("empty", name)  # no memory to share
        first = seen.get(key)
        if first is None:
            seen[key], kept[name] = name, tensor
        elif TIED_ALIASES.get(first) == name:  # the alias came first: the stored name wins
            del kept[first]
            seen[key], kept[name] = name, tensor
        # else: memory already listed under another name, kept once (as named_parameters does)
    for alias, target in TIED_ALIASES.items():
        a, t = kept.get(alias), kept.get(target)
        if a is not None and t is not None and _bit_equal(a, t):
            del kept[alias]
    yield from kept.items()


def checksum_named_tensors(named_tensors: NamedTensors) -> dict[str, str]:
    """name -> blake2b hex digest of the tensor's dtype, shape and raw bytes, over the
    canonical listing (`canonical_named_tensors`), so trainer and engine compare the same
    set of names however each lists tied weights.

    Exact: equal digests mean bit-identical tensors (any dtype, bfloat16 included), so
    `--check-weight-update-equal` can compare trainer and engine weights without tolerances.
    """
    out = {}
    for name, tensor in canonical_named_tensors(named_tensors):
        tensor = tensor.detach().to("cpu").contiguous()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{dtype_name(tensor.dtype)}{list(tensor.shape)}".encode())
        # Viewing as bytes needs at least one dim; reshape(-1) also covers 0-d tensors.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = digest.hexdigest()
    return out


def _memory_identity(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors that view the same elements of the same memory."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().to("cpu").contiguous(), b.detach().to("cpu").contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


class _OpenBucket:
    """The bucket being filled for one dtype, over its reusable flat buffer."""

    def __init__(self, dtype: torch.dtype, buffer_bytes: int, device: torch.device):
        self.dtype = dtype
        self.buffer = torch.empty(_buffer_elements(dtype, buffer_bytes), dtype=dtype, device=device)
        self.names: list[str] = []
        self.shapes: list[list[int]] = []
        self.used = 0  # elements filled

    def fits(self, tensor: torch.Tensor) -> bool:
        return self.used + tensor.numel() <= self.buffer.numel()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.buffer[self.used : self.used + tensor.numel()].copy_(tensor.reshape(-1))
        self.names.append(name)
        self.shapes.append(list(tensor.shape))
        self.used += tensor.numel()

    def seal(self) -> dict:
        return _bucket(self.dtype, self.names, self.shapes, self.buffer[: self.used])

    def clear(self) -> None:
        self.names, self.shapes, self.used = [], [], 0


def _bucket(dtype: torch.dtype, names: list[str], shapes: list[list[int]], flat: torch.Tensor) -> dict:
    return {"dtype": dtype_name(dtype), "names": names, "shapes": shapes, "flat": flat}


def _buffer_elements(dtype: torch.dtype, buffer_bytes: int) -> int:
    return buffer_bytes // torch.empty((), dtype=dtype).element_size()


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel
