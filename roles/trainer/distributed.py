"""torch.distributed for a trainer rank: joining the group the supervisor started, and the
few collectives the torch backend's data parallelism needs.

A rank finds MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK in its environment
(roles.trainer.group, the rank contract). A trainer built in-process (unit tests) has no
such environment and no process group: every function here is then the identity.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from runtime.fakegpu import visible_fake_devices

# A collective whose peer never comes fails after this long instead of hanging the role
# (a dead peer's connection usually fails it much sooner).
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# Gradients are all-reduced in flat buckets of about this size: one collective per bucket.
BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class Rank:
    rank: int
    world_size: int

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_from_env(backend: str | None = None) -> Rank:
    """Join the rank group described by the environment; Rank(0, 1) without one. The store at
    MASTER_ADDR:MASTER_PORT is the launcher's (runtime.rendezvous): every rank connects to it
    as a client. `backend` defaults to gloo on fake GPUs and the CPU, gloo for CPU tensors and
    NCCL for CUDA tensors on GPUs."""
    if "WORLD_SIZE" not in os.environ:
        return Rank(0, 1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():
        if backend is None:
            cuda = torch.cuda.is_available() and not visible_fake_devices()
            backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=False, timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    return Rank(rank, world)


def all_reduce_sum_(tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` over the ranks, in place, in flat buckets per dtype and device."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group + [None]:
            if t is not None and (not bucket or size + t.numel() * t.element_size() <= BUCKET_BYTES):
                bucket.append(t)
                size += t.numel() * t.element_size()
                continue
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(part.view_as(b))
            bucket, size = ([t], t.numel() * t.element_size()) if t is not None else ([], 0)


def all_reduce_floats(values: dict[str, float]) -> dict[str, float]:
    """{name: value summed over the ranks}; every rank passes the same names."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    keys = sorted(values)
    flat = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(flat)
    return dict(zip(keys, flat.tolist()))


def is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
