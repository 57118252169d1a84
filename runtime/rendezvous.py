"""The rendezvous store of a rank group, hosted by whoever starts the ranks.

torch's env:// rendezvous has rank 0 listen on MASTER_PORT; a launcher that picks that port
by binding port 0 and closing it leaves a window in which another process can take it (CI
saw a rank fail with EADDRINUSE). The launcher hosts the store instead: the store's own
server binds port 0 and keeps the port until the launcher drops it, and every rank connects
as a client (roles.trainer.distributed.init_from_env).

The nodes of a multi-node job meet the same way (`meet`): node 0 serves the job's store
(the c10d TCPStore torchrun uses; under torchrun its agent's), and every node publishes there
its control endpoint and CURVE public key (runtime.curve) and reads the others'.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable


def host_store(host: str, world_size: int):
    """A TCPStore server listening on a port the OS chose; `.port` is the port to hand the
    ranks (MASTER_PORT). It serves while the returned object lives."""
    import torch.distributed as dist  # only launchers of rank groups pay for the import

    return dist.TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False)


class RendezvousFailed(Exception):
    """The nodes of a job did not meet; the message is one line that says what to do."""


@dataclass(frozen=True)
class NodeEntry:
    """What a node publishes in the job's store: where its control socket listens and the CURVE
    public key it answers with (runtime.curve)."""

    rank: int
    endpoint: str  # tcp://ADDRESS:PORT
    public_key: bytes  # Z85

    def encode(self) -> bytes:
        return json.dumps({"rank": self.rank, "endpoint": self.endpoint,
                           "public_key": self.public_key.decode()}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "NodeEntry":
        d = json.loads(raw)
        return cls(int(d["rank"]), str(d["endpoint"]), str(d["public_key"]).encode())


@dataclass
class Rendezvous:
    """Every node's entry, by rank. Node 0's store serves while this object lives."""

    nodes: list[NodeEntry]
    store: Any


def meet(master_addr: str, master_port: int, *, nnodes: int, entry: NodeEntry, timeout_s: float,
         host: bool, prefix: str = "tandem", on_node_0: Callable[[NodeEntry], None] | None = None) -> Rendezvous:
    """Publish `entry` in the job's c10d TCPStore at master_addr:master_port and wait for the
    entries of all `nnodes` nodes. `host`: this node serves the store (node 0, unless torchrun's
    agent already serves one there). `on_node_0(node 0's entry)`: called on a node > 0 before it
    publishes its own entry, so that it admits node 0's key before node 0 can dial it (a CURVE
    handshake refused by the ZAP handler lost node 0's first message). Raises RendezvousFailed
    within about `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    where = f"{master_addr}:{master_port}"
    if not host:  # fail with our own line, not c10d's retry log, when node 0 is not there
        _wait_reachable(master_addr, master_port, deadline, timeout_s)
    import torch.distributed as dist  # only a launcher that reached the store pays for the import
    try:
        store = dist.TCPStore(master_addr, master_port, nnodes, is_master=host, wait_for_workers=False,
                              timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
        if host:
            raise RendezvousFailed(f"node 0 cannot serve the rendezvous store on port {master_port} "
                                   f"({_first_line(e)}): another job may hold it; pass another --master-port") from None
        raise RendezvousFailed(f"node 0's rendezvous store at {where} did not answer ({_first_line(e)}): "
                               "check --master-addr and --master-port") from None
    # a node that node 0 lost and calls back (`call_back`) joins the newest generation, where only
    # node 0 and itself meet; the first meeting is generation 0
    generation = int(store.get(f"{prefix}/generation")) if store.check([f"{prefix}/generation"]) else 0
    if store.add(f"{prefix}/claim/{generation}/{entry.rank}", 1) > 1:
        raise RendezvousFailed(f"another launcher already joined as node {entry.rank}: give each launcher "
                               "its own --node-rank (a node started again before node 0 noticed it lost: start "
                               "it once more)")
    if on_node_0 is not None and entry.rank != 0:
        first = f"{prefix}/node/{generation}/0"
        while not store.check([first]):
            if time.monotonic() > deadline:
                raise RendezvousFailed(f"node(s) 0 of {nnodes} did not join the rendezvous at {where} within "
                                       f"{timeout_s:g} s (--rendezvous-timeout-s): start one launcher per node")
            time.sleep(0.05)
        on_node_0(NodeEntry.decode(store.get(first)))
    store.set(f"{prefix}/node/{generation}/{entry.rank}", entry.encode())
    ranks = list(range(nnodes)) if generation == 0 else [0, entry.rank]
    keys = [f"{prefix}/node/{generation}/{r}" for r in ranks]
    while not store.check(keys):  # polled: c10d's blocking wait logs its timeout on stderr
        if time.monotonic() > deadline:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
            raise RendezvousFailed(f"node(s) {', '.join(map(str, missing))} of {nnodes} did not join the "
                                   f"rendezvous at {where} within {timeout_s:g} s (--rendezvous-timeout-s): "
                                   "start one launcher per node")
        time.sleep(0.05)
    return Rendezvous([NodeEntry.decode(store.get(k)) for k in keys], store)


def call_back(rdv: Rendezvous, rank: int, node0: NodeEntry, timeout_s: float, prefix: str = "tandem") -> NodeEntry:
    """Node 0: open a new generation of the job's rendezvous for node `rank`, which was lost, and
    wait up to `timeout_s` for a launcher of that rank to join it (`meet` started again there, by
    hand or by the scheduler); returns its entry. Raises RendezvousFailed, one line."""
    generation = rdv.store.add(f"{prefix}/generation", 1)
    rdv.store.set(f"{prefix}/node/{generation}/0", node0.encode())
    key, deadline = f"{prefix}/node/{generation}/{rank}", time.monotonic() + timeout_s
    while not rdv.store.check([key]):
        if time.monotonic() > deadline:
            raise RendezvousFailed(f"node {rank} did not come back within {timeout_s:g} s "
                                   "(--rendezvous-timeout-s)")
        time.sleep(0.05)
    return NodeEntry.decode(rdv.store.get(key))


def _wait_reachable(addr: str, port: int, deadline: float, timeout_s: float) -> None:
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            reason = last.strerror if isinstance(last, OSError) and last.strerror else str(last)
            raise RendezvousFailed(f"node 0's rendezvous store at {addr}:{port} did not answer within "
                                   f"{timeout_s:g} s ({reason}): start node 0 (--node-rank 0), or check "
                                   "--master-addr and --master-port")
        time.sleep(0.1)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
