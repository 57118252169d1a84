"""CUDA IPC handles for tensors, in a form that travels on Tandem's wire (no pickle).

The actor trainer and a rollout engine on the same physical GPU share a weight bucket
without copying it through host memory: the sender describes the bucket's device memory
with an IPC handle, the receiver maps it and copies straight into its parameters. torch's
own reducer (`torch.multiprocessing.reductions`) makes the handle; we only turn its
arguments (classes, dtypes, a device index) into plain values and back.

Device indices are per process (each role sees its own `CUDA_VISIBLE_DEVICES`), so a
handle names the *physical* GPU and the receiver maps it to its local index.
"""

from __future__ import annotations

import os

import torch


_STORAGES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.storage.UntypedStorage}


def physical_gpu(local_index: int) -> int:
    """The physical id of a local CUDA device index, from CUDA_VISIBLE_DEVICES."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return local_index
    return int(visible.split(",")[local_index])


def local_index(physical: int) -> int | None:
    """This process's index of a physical GPU, or None when it cannot see that GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return physical if physical < torch.cuda.device_count() else None
    ids = [int(v) for v in visible.split(",")]
    return ids.index(physical) if physical in ids else None


def share(t: torch.Tensor) -> dict:
    """A wire-safe description of a CUDA tensor's memory (the sender keeps `t` alive)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset,
     _, ref_handle, ref_offset, event_handle, event_sync) = args
    return {"gpu": physical_gpu(device), "size": list(size), "stride": list(stride), "offset": offset,
            "storage": storage_cls.__name__,
            "dtype": str(dtype).removeprefix("torch."), "handle": handle, "storage_bytes": storage_bytes,
            "storage_offset": storage_offset, "ref_handle": ref_handle, "ref_offset": ref_offset,
            "event_handle": event_handle, "event_sync": event_sync}


def open_shared(d: dict) -> torch.Tensor:
    """Map a tensor described by `share` in another process on the same physical GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = local_index(d["gpu"])
    if device is None:
        raise RuntimeError(f"CUDA IPC: this process cannot see physical GPU {d['gpu']} "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(d["size"]), tuple(d["stride"]), d["offset"],
                               _STORAGES[d["storage"]], getattr(torch, d["dtype"]), device,
                               d["handle"], d["storage_bytes"], d["storage_offset"], False,
                               d["ref_handle"], d["ref_offset"], d["event_handle"], d["event_sync"])
