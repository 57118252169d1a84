"""The rendezvous store of a rank group, hosted by whoever starts the ranks.

torch's env:// rendezvous has rank 0 listen on MASTER_PORT; a launcher that picks that port
by binding port 0 and closing it leaves a window in which another process can take it (CI
saw a rank fail with EADDRINUSE). The launcher hosts the store instead: the store's own
server binds port 0 and keeps the port until the launcher drops it, and every rank connects
as a client (roles.trainer.distributed.init_from_env).

The nodes of a multi-node job meet the same way (`meet`): node 0 serves the job's store
(the c10d TCPStore torchrun uses; under torchrun its agent's), and every node publishes there
its control endpoint and CURVE public key (runtime.curve), signed under the job's secret
(runtime.signing), and reads the others'.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from runtime.signing import SECRET_ENV, JobSecret

logger = logging.getLogger(__name__)


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
    public key it answers with (runtime.curve). In the store it is signed (`_Board`)."""

    rank: int
    endpoint: str  # tcp://ADDRESS:PORT
    public_key: bytes  # Z85


@dataclass
class Rendezvous:
    """Every node's entry, by rank. Node 0's store serves while this object lives. `run` is node
    0's nonce for this run, which every signed entry and node 0's hello carry; `epoch` is the
    start of the job it met in, whose keys in the store (`prefix`, `tandem/E`) are where
    `call_back` opens new generations."""

    nodes: list[NodeEntry]
    store: Any
    secret: JobSecret
    run: str
    where: str
    base: str  # the job's keys in the store, every epoch's: `meet`'s prefix
    epoch: int
    _store_gone: bool = field(default=False, init=False, repr=False)

    @property
    def prefix(self) -> str:
        return f"{self.base}/{self.epoch}"

    def superseded(self) -> bool:
        """Whether node 0 has opened a newer epoch since this meeting: the job started again, and
        a node that met the earlier start's node 0 is to meet again. False once the store does
        not answer (the store of node 0's own launcher ends with it: no newer epoch comes there)."""
        if self._store_gone:
            return False
        try:
            return self.store.add(f"{self.base}/epochs", 0) != self.epoch
        except (RuntimeError, OSError):  # DistNetworkError is a RuntimeError; c10d logs it, once
            self._store_gone = True
            return False


def meet(master_addr: str, master_port: int, *, nnodes: int, entry: NodeEntry, secret: JobSecret, timeout_s: float,
         host: bool, prefix: str = "tandem", on_node_0: Callable[[NodeEntry], None] | None = None) -> Rendezvous:
    """Publish `entry`, signed under the job's `secret`, in the job's c10d TCPStore at
    master_addr:master_port and wait for the signed entries of all `nnodes` nodes; an entry whose
    signature does not verify is logged and passed over. `host`: this node serves the store
    (node 0, unless torchrun's agent already serves one there). `on_node_0(node 0's entry)`:
    called on a node > 0 before it publishes its own entry, so that it admits node 0's key
    before node 0 can dial it (a CURVE handshake refused by the ZAP handler lost node 0's first
    message). Raises RendezvousFailed within about `timeout_s`."""
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
    # Each start of the job meets in an epoch of its own, opened by node 0: a store can outlive a
    # start (torchrun's agent store serves every restart of its workers), and the entries of an
    # earlier start must not be taken for this one's. Within an epoch, a node that node 0 lost and
    # calls back (`call_back`) joins the newest generation, where only node 0 and itself meet.
    # A node > 0 can read the epochs before the new node 0 has opened its own, and join the earlier
    # start's epoch where its place is free: it meets again once a newer epoch opens (`_Superseded`
    # here, Rendezvous.superseded once met).
    epochs = f"{prefix}/epochs"
    epoch = store.add(epochs, 1) if entry.rank == 0 else 0
    while True:
        if entry.rank:  # the newest epoch, once node 0 has opened one
            while (epoch := store.add(epochs, 0)) == 0:
                if time.monotonic() > deadline:
                    raise _missing(where, nnodes, [0], timeout_s)
                time.sleep(0.05)
        rdv = Rendezvous([], store, secret, "", where, prefix, epoch)
        generation = _generation(store, rdv.prefix)
        try:
            if generation and store.get(f"{rdv.prefix}/callback/{generation}") != str(entry.rank).encode():
                raise _PlaceTaken(_taken(entry.rank))  # node 0 calls back another node: not a place for this one
            return _meet(rdv, generation, entry, nnodes, deadline, timeout_s, on_node_0)
        except _Superseded:
            continue
        except _PlaceTaken as taken:
            if entry.rank == 0:  # its epoch is its own: never taken
                raise
            # the place is this node's own from an earlier start (node 0 opens a new epoch once it
            # starts again) or from before node 0 noticed it lost it (node 0 calls it back in a
            # new generation); else another launcher holds it
            while store.add(epochs, 0) == epoch and _generation(store, rdv.prefix) == generation:
                if time.monotonic() > deadline:
                    raise RendezvousFailed(str(taken)) from None
                time.sleep(0.05)


def _meet(rdv: Rendezvous, generation: int, entry: NodeEntry, nnodes: int, deadline: float, timeout_s: float,
          on_node_0) -> Rendezvous:
    """Meet in `rdv`'s epoch and `generation`; returns `rdv` with its nodes and run filled in."""
    where = rdv.where
    # node 0's epoch is its own; another node stops waiting there once a newer one opens
    board = _Board(rdv.store, rdv.prefix, generation, rdv.secret, where,
                   superseded=rdv.superseded if entry.rank else None)
    ranks = list(range(nnodes)) if generation == 0 else [0, entry.rank]

    def missing(waited: list[int]) -> Callable[[], RendezvousFailed]:
        return lambda: _missing(where, nnodes, board.missing(waited), timeout_s)

    if entry.rank == 0:
        run = secrets.token_hex(16)
    else:  # node 0's run nonce goes into this node's signature: an entry of another run does not verify
        node_0 = board.wait(0, None, deadline, missing([0]))
        run = node_0.run
        if on_node_0 is not None:
            on_node_0(node_0.entry)
    board.offer(entry, run, deadline, missing([entry.rank]))
    rdv.nodes, rdv.run = [board.wait(r, run if r else None, deadline, missing(ranks)).entry for r in ranks], run
    return rdv


def _generation(store, prefix: str) -> int:
    return int(store.get(f"{prefix}/generation")) if store.check([f"{prefix}/generation"]) else 0


def _missing(where: str, nnodes: int, ranks: list[int], timeout_s: float) -> RendezvousFailed:
    return RendezvousFailed(
        f"node(s) {', '.join(map(str, ranks))} of {nnodes} did not join the rendezvous at {where} within "
        f"{timeout_s:g} s (--rendezvous-timeout-s): start one launcher per node, each with the job's {SECRET_ENV}")


def _taken(rank: int) -> str:
    return f"another launcher already joined as node {rank}: give each launcher its own --node-rank"


class _PlaceTaken(RendezvousFailed):
    """A launcher holding the job's secret offered itself as this node's rank first."""


class _Superseded(Exception):
    """Node 0 opened a newer epoch while this node waited in an earlier one."""


def call_back(rdv: Rendezvous, rank: int, node0: NodeEntry, timeout_s: float) -> NodeEntry:
    """Node 0: open a new generation of the job's rendezvous for node `rank`, which was lost, and
    wait up to `timeout_s` for a launcher of that rank to join it (`meet` started again there, by
    hand or by the scheduler, with the job's secret); returns its entry. Raises
    RendezvousFailed, one line."""
    # which node the generation is for, written before the generation opens: only that rank joins it
    rdv.store.set(f"{rdv.prefix}/callback/{_generation(rdv.store, rdv.prefix) + 1}", str(rank))
    generation = rdv.store.add(f"{rdv.prefix}/generation", 1)
    board = _Board(rdv.store, rdv.prefix, generation, rdv.secret, rdv.where)
    deadline = time.monotonic() + timeout_s

    def gone() -> RendezvousFailed:
        return RendezvousFailed(f"node {rank} did not come back within {timeout_s:g} s (--rendezvous-timeout-s)")

    board.offer(node0, rdv.run, deadline, gone)
    return board.wait(rank, rdv.run, deadline, gone).entry


@dataclass(frozen=True)
class _Signed:
    entry: NodeEntry
    run: str


class _Board:
    """The entries of one generation in the store. Whoever reaches the store can write there, so
    a rank's place is not a key that the first writer takes: each launcher that offers itself as
    node R takes the next slot of R (`add`) and writes its entry, signed over the job, the run,
    the generation, the slot and the entry itself, at that slot. Node R is the lowest slot whose
    entry verifies, decided once every lower slot is written; an entry that does not verify is
    logged once and passed over. A copy of a good entry at another slot does not verify."""

    def __init__(self, store: Any, prefix: str, generation: int, secret: JobSecret, where: str,
                 superseded: Callable[[], bool] | None = None):
        self.store, self.secret, self.where, self.superseded = store, secret, where, superseded
        self.prefix, self.generation = f"{prefix}/node/{generation}", generation
        self._counter = f"{prefix}/offers/{generation}"
        self._refused: set[tuple[int, int]] = set()  # (rank, slot)
        self._found: dict[int, _Signed] = {}

    def offer(self, entry: NodeEntry, run: str, deadline: float, timed_out: Callable[[], Exception]) -> None:
        """Write `entry` at its rank's next slot; RendezvousFailed when a launcher that holds the
        job's secret offered itself as that rank first."""
        slot = self.store.add(f"{self._counter}/{entry.rank}", 1)
        mac = self._sign(entry, run, slot)
        self.store.set(f"{self.prefix}/{entry.rank}/{slot}", json.dumps(
            {"endpoint": entry.endpoint, "public_key": entry.public_key.decode(), "run": run, "mac": mac}))
        first = self.wait(entry.rank, run if entry.rank else None, deadline, timed_out)
        if first.entry != entry:
            raise _PlaceTaken(_taken(entry.rank))

    def wait(self, rank: int, run: str | None, deadline: float, timed_out: Callable[[], Exception]) -> _Signed:
        """Node `rank`'s entry, once it is there; `run`: the run it must be signed for (None: any,
        for node 0's own entry, which declares the run). Polled: c10d's blocking wait logs its
        timeout on stderr."""
        while (found := self._find(rank, run)) is None:
            if time.monotonic() > deadline:
                raise timed_out()
            if self.superseded is not None and self.superseded():
                raise _Superseded
            time.sleep(0.05)
        return found

    def missing(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if r not in self._found]

    def _find(self, rank: int, run: str | None) -> _Signed | None:
        if rank in self._found:
            return self._found[rank]
        for slot in range(1, self.store.add(f"{self._counter}/{rank}", 0) + 1):
            if (rank, slot) in self._refused:
                continue
            key = f"{self.prefix}/{rank}/{slot}"
            if not self.store.check([key]):
                return None  # taken, not written yet: the lower slot decides first
            found, why = self._verify(self.store.get(key), rank, slot, run)
            if found is not None:
                self._found[rank] = found
                return found
            self._refused.add((rank, slot))
            logger.warning("tandem: refused an entry for node %d in the rendezvous store at %s (generation %d, "
                           "slot %d): %s", rank, self.where, self.generation, slot, why)
        return None

    def _verify(self, raw: bytes, rank: int, slot: int, run: str | None) -> tuple[_Signed | None, str]:
        try:
            d = json.loads(raw)
            entry = NodeEntry(rank, str(d["endpoint"]), str(d["public_key"]).encode())
            entry_run, mac = d["run"], d.get("mac")
        except (ValueError, TypeError, KeyError):
            return None, "not an entry that a launcher of this version writes"
        if not mac:
            return None, f"it is not signed (its launcher has no {SECRET_ENV})"
        if run is not None and entry_run != run:
            return None, "it names another run than node 0's (a launcher of an earlier run of the job)"
        if not self.secret.verify(mac, "node-entry", self._signed_fields(entry, str(entry_run), slot)):
            return None, (f"its signature does not verify under this job's {SECRET_ENV} (a launcher without the "
                          "job's secret, or of another job)")
        return _Signed(entry, str(entry_run)), ""

    def _sign(self, entry: NodeEntry, run: str, slot: int) -> str:
        return self.secret.sign("node-entry", self._signed_fields(entry, run, slot))

    def _signed_fields(self, entry: NodeEntry, run: str, slot: int) -> dict:
        return {"run": run, "generation": self.generation, "slot": slot, "rank": entry.rank,
                "endpoint": entry.endpoint, "public_key": entry.public_key}


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
