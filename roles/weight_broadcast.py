"""The weight sync to engines on other nodes: a torch.distributed group of its own.

Engines on the actor's node take the weight buckets as today (roles.weight_sync: CUDA IPC on
a GPU, frames through shared memory on the CPU). Engines on other nodes would otherwise take
them as tcp frames through the CURVE control plane (~310 MB/s measured on one box:
docs/multinode.md), so they join a broadcast group with the actor's rank 0 instead, as
miles/slime (`init_weights_update_group`) and verl do for their engines: NCCL where the
weights are on GPUs, gloo on the CPU and fake GPUs. The actor is rank 0 of the group, each
such engine a rank after it.

Per bucket the actor calls each remote engine's `receive_weights(meta)` (names, shapes and
dtype: the bucket without its tensor) and then broadcasts the bucket's flat tensor from rank 0;
each engine receives into a buffer of its own, loads it through the same checks as a bucket
that came by IPC (roles.rollout.engine.update_weights), and its answer is the ack. The sender
reuses a bucket's buffer only after every ack (roles.weight_sync.push_weights), as before.

The group is not the trainer's default process group: the actor's ranks already have one
(their own world), and a process has only one. It is a ProcessGroupGloo or ProcessGroupNCCL
made directly over a PrefixStore of the store the driver hosts for it, outside the default
group's bookkeeping.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=10)  # a broadcast waits this long for a member that never joins it


class WeightGroup:
    """This process's membership in a weight broadcast group (`join`)."""

    def __init__(self, pg, rank: int, world_size: int, backend: str):
        self.pg, self.rank, self.world_size, self.backend = pg, rank, world_size, backend

    @classmethod
    def join(cls, master_addr: str, master_port: int, world_size: int, rank: int, backend: str) -> "WeightGroup":
        """Meet the group's other members at the store on master_addr:master_port (hosted by the
        driver, runtime.rendezvous.host_store); returns once every member joined."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend={backend!r}: allowed values are 'gloo' and 'nccl'")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in 0..{world_size - 1}")
        store = dist.PrefixStore("weights/", dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                                                           timeout=TIMEOUT))
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(store, rank, world_size, TIMEOUT)
        else:  # never ran across GPUs here (docs/multinode.md)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        group = cls(pg, rank, world_size, backend)
        group.broadcast(torch.zeros(1, device=group.device()))  # every member is in before the first sync
        return group

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every member's (same shape and dtype), in place; returns when
        this member's part is done."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()


def bucket_meta(bucket: dict) -> dict:
    """What a receiver needs to receive a packed bucket's flat tensor: the bucket without it."""
    flat = bucket["flat"]
    return {"dtype": bucket["dtype"], "names": bucket["names"], "shapes": bucket["shapes"], "numel": flat.numel()}


def receive_bucket(group: WeightGroup, meta: dict) -> dict:
    """A member's side of one bucket's broadcast: the packed bucket, its flat tensor received."""
    flat = torch.empty(meta["numel"], dtype=getattr(torch, meta["dtype"]), device=group.device())
    group.broadcast(flat)
    return {"dtype": meta["dtype"], "names": meta["names"], "shapes": meta["shapes"], "flat": flat}
