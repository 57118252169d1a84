"""The rendezvous store of a rank group, hosted by whoever starts the ranks.

torch's env:// rendezvous has rank 0 listen on MASTER_PORT; a launcher that picks that port
by binding port 0 and closing it leaves a window in which another process can take it (CI
saw a rank fail with EADDRINUSE). The launcher hosts the store instead: the store's own
server binds port 0 and keeps the port until the launcher drops it, and every rank connects
as a client (roles.trainer.distributed.init_from_env).
"""

from __future__ import annotations


def host_store(host: str, world_size: int):
    """A TCPStore server listening on a port the OS chose; `.port` is the port to hand the
    ranks (MASTER_PORT). It serves while the returned object lives."""
    import torch.distributed as dist  # only launchers of rank groups pay for the import

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)
