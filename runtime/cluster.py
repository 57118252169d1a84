"""Node 0's supervisor and the other nodes' agents, as the one supervisor the driver knows.

A job across nodes numbers GPUs globally, as its placement does: GPU `g` is local GPU
`g % per_node` of node `g // per_node`. `ClusterSupervisor` takes those ids and starts each
role on its node: node 0's through node 0's own `Supervisor`, another node's through its
`RemoteNode` (runtime.agent), whose agent runs the same Supervisor there. A rank group may
span nodes: node 0 hosts its store and starts the first slice, every other node its own.

`ClusterLeases` is the lease table over every node's GPUs: a GPU's lease lives on its node
(the fake GPUs' ledgers, which the roles there write, are that node's), and node 0's driver
moves it there over the agent's channel. `acquire_all` and `release_all` are all-or-none per
node only: a conflict on node 1 leaves node 0's leases of the same call changed.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Mapping, Sequence

from runtime.actor import endpoints_of
from runtime.agent import NodeLost, RemoteNode
from runtime.curve import KeyPair
from runtime.handle import ActorHandle
from runtime.memory import Grant
from runtime.rendezvous import Rendezvous, call_back
from runtime.supervisor import Supervisor


class ClusterLeases:
    """The LeaseTable methods the driver's memory handoff calls (ppo.gpu.colocation), on
    global GPU ids, each forwarded to the table of the GPU's node."""

    def __init__(self, local, remotes: Mapping[int, RemoteNode], per_node: int):
        self._local, self._remotes, self._per_node = local, remotes, per_node

    def _call(self, node: int, op: str, *args, **kwargs) -> Any:
        if node == 0:
            return getattr(self._local, op)(*args, **kwargs)
        return self._remotes[node].lease(op, *args, **kwargs)

    def _at(self, gpu: int) -> tuple[int, int]:
        return divmod(gpu, self._per_node)

    def _by_node(self, gpus: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = collections.defaultdict(list)
        for g in gpus:
            node, local = self._at(g)
            out[node].append(local)
        return out

    def _global(self, node: int, grant: Grant | dict) -> Grant:
        if isinstance(grant, dict):
            grant = Grant(**grant)
        return Grant(gpu=node * self._per_node + grant.gpu, holder=grant.holder, residuals=grant.residuals)

    def acquire(self, gpu: int, holder: str) -> Grant:
        node, local = self._at(gpu)
        return self._global(node, self._call(node, "acquire", local, holder))

    def acquire_all(self, gpus: list[int], holder: str) -> list[Grant]:
        return [self._global(node, g) for node, local in self._by_node(gpus).items()
                for g in self._call(node, "acquire_all", local, holder)]

    def release(self, gpu: int, holder: str, bytes_left: int, *, may_keep: int = 0) -> None:
        node, local = self._at(gpu)
        self._call(node, "release", local, holder, bytes_left, may_keep=may_keep)

    def release_all(self, gpus: list[int], holder: str, bytes_left_by_gpu: Mapping[int, int], *,
                    may_keep: int | Mapping[int, int] = 0) -> None:
        for node, local in self._by_node(gpus).items():
            first = node * self._per_node
            left = {g: bytes_left_by_gpu[first + g] for g in local}
            keep = ({g: may_keep.get(first + g, 0) for g in local} if isinstance(may_keep, Mapping) else may_keep)
            self._call(node, "release_all", local, holder, left, may_keep=keep)

    def report(self, gpu: int, holder: str, nbytes: int) -> None:
        node, local = self._at(gpu)
        self._call(node, "report", local, holder, nbytes)

    def holds(self, gpu: int, holder: str) -> bool:
        node, local = self._at(gpu)
        return self._call(node, "holds", local, holder)

    def holder(self, gpu: int, *, like: str | None = None) -> str | None:
        node, local = self._at(gpu)
        return self._call(node, "holder", local, like=like)

    def same_lease(self, gpu: int, a: str, b: str) -> bool:
        node, local = self._at(gpu)
        return self._call(node, "same_lease", local, a, b)

    def forget(self, gpus: list[int], holder: str) -> None:
        for node, local in self._by_node(gpus).items():
            self._call(node, "forget", local, holder)

    def drop_dead_memory(self, gpus: list[int], holder: str) -> None:
        for node, local in self._by_node(gpus).items():
            self._call(node, "drop_dead_memory", local, holder)

    def split(self, gpu: int, budgets) -> None:
        raise ValueError("side by side (--train-async --colocate) is not built across nodes: its budgets would "
                         "have to split each node's leases; place the roles on one node or disaggregate them")


class ClusterSupervisor:
    """The driver's supervisor for a job across nodes: Supervisor's methods that the driver
    calls, on global GPU ids. `remotes` are the RemoteNodes of nodes 1..N-1 (connected);
    `rendezvous` (node 0's store, runtime.rendezvous) is kept serving until shutdown, and with
    node 0's `keys` (those the agents admit) it lets a lost node join again (`call_back`)."""

    def __init__(self, sup: Supervisor, remotes: Mapping[int, RemoteNode], per_node: int,
                 rendezvous: Rendezvous | None = None, keys: KeyPair | None = None):
        self.sup, self.remotes, self.per_node = sup, dict(remotes), per_node
        self.leases = ClusterLeases(sup.leases, self.remotes, per_node)  # sees remotes replaced by call_back
        self.run_dir, self.bus, self.caller, self.directory = sup.run_dir, sup.bus, sup.caller, sup.directory
        self.heartbeat_interval = sup.heartbeat_interval
        self._node_of_role: dict[str, int] = {}  # every role's node; node 0 when not here
        # how each role of another node was spawned, to spawn it again on that node when it comes
        # back: {name: (cls, args, kwargs)}; rank groups {name: (cls, args, kwargs, slices)}
        self._specs: dict[str, tuple] = {}
        self._group_specs: dict[str, tuple] = {}
        self._incarnations: dict[str, int] = {}  # the last incarnation of a lost node's roles
        self._fresh_slices: set[tuple[int, str]] = set()  # (node, group): a slice on a node that came back
        self._rendezvous, self._keys = rendezvous, keys
        self._closed = False

    @property
    def num_nodes(self) -> int:
        return 1 + len(self.remotes)

    def node_of(self, name: str) -> int:
        return self._node_of_role.get(name, 0)

    def _node(self, name: str, gpus: Sequence[int]) -> tuple[int, list[int]]:
        nodes = {g // self.per_node for g in gpus}
        if len(nodes) > 1:
            raise ValueError(f"{name}: gpus {list(gpus)} are on nodes {sorted(nodes)}; a process runs on one node")
        node = nodes.pop() if nodes else 0
        if node >= self.num_nodes:
            raise ValueError(f"{name}: gpus {list(gpus)} are on node {node}, past the job's {self.num_nodes} nodes")
        return node, [g % self.per_node for g in gpus]

    def spawn(self, name: str, cls: type, *args, gpus: Sequence[int] = (), **kwargs) -> ActorHandle:
        """Supervisor.spawn on the node of `gpus` (node 0 without GPUs: CPU roles run by the driver)."""
        node, local = self._node(name, gpus)
        self._node_of_role[name] = node
        if node == 0:
            return self.sup.spawn(name, cls, *args, gpus=local, **kwargs)
        self._specs[name] = (cls, args, {**kwargs, "gpus": local})
        return self.remotes[node].spawn(name, cls, *args, gpus=local, **kwargs)

    def spawn_group(self, name: str, cls: type, *args, gpus: Sequence[int], env: dict[str, str] | None = None,
                    **kwargs) -> list[ActorHandle]:
        """A rank group over `gpus` (rank i on gpus[i]), each node starting its slice; node 0
        hosts the group's store, so the group must have ranks there (rank 0 first)."""
        slices: list[tuple[int, list[int]]] = []
        for g in gpus:
            node, local = divmod(g, self.per_node)
            if slices and slices[-1][0] == node:
                slices[-1][1].append(local)
            elif any(n == node for n, _ in slices):
                raise ValueError(f"{name}: gpus {list(gpus)} visit node {node} twice; give each node's ranks in a row")
            else:
                slices.append((node, [local]))
        if slices[0][0] != 0:
            raise ValueError(f"{name}: its rank 0 is on node {slices[0][0]}; a rank group across nodes starts "
                             "on node 0, which hosts its store")
        self._group_specs[name] = (cls, args, {**kwargs, "env": env}, slices)
        world, handles = len(gpus), []
        for node, local in slices:
            if node == 0:
                handles += self.sup.spawn_group(name, cls, *args, gpus=local, env=env, world_size=world, **kwargs)
            else:
                handles += self.remotes[node].spawn_group(name, cls, *args, gpus=local, world_size=world,
                                                          first_rank=len(handles), master=self.sup.group_master(name),
                                                          env=env, **kwargs)
            for h in handles[-len(local):]:
                self._node_of_role[h.name] = node
        return handles

    def wait_ready(self, names: Sequence[str] | None = None, timeout: float = 300.0) -> None:
        names = list(self._node_of_role) if names is None else list(names)
        by_node: dict[int, list[str]] = collections.defaultdict(list)
        for n in names:
            by_node[self.node_of(n)].append(n)
        for node, group in sorted(by_node.items(), reverse=True):  # node 0 last: the remote waits are longer
            if node == 0:
                self.sup.wait_ready(group, timeout=timeout)
            else:
                self.remotes[node].wait_ready(group, timeout=timeout)

    def wait_restarted(self, name: str, dead_incarnation: int, timeout: float = 300.0) -> int:
        node = self.node_of(name)
        if node == 0:
            return self.sup.wait_restarted(name, dead_incarnation, timeout=timeout)
        return self.remotes[node].wait_restarted(name, dead_incarnation, timeout=timeout)

    def restart_counts(self) -> dict[str, int]:
        counts = collections.Counter(self.sup.restart_counts())
        for remote in self.remotes.values():
            counts.update(remote.restarts)
        return dict(counts)

    def respawn_group(self, name: str, reason: str, timeout: float = 60.0) -> list[ActorHandle]:
        """Supervisor.respawn_group; a group that spans nodes restarts as one: node 0's slice on a
        new store, then each other node's slice joining it: anew on a node that came back
        (`call_back`), whose supervisor never had the group, else by that node's supervisor
        (RemoteNode.respawn_group), past the incarnations the slice ran."""
        cls, args, kwargs, slices = self._group_specs[name]
        if all(node == 0 for node, _ in slices):
            return self.sup.respawn_group(name, reason, timeout=timeout)
        with contextlib.ExitStack() as respawning:
            for node, _ in slices[1:]:  # before node 0's slice stops: those stops are no deaths to act on
                respawning.enter_context(self.remotes[node].respawning(name))
            handles = self.sup.respawn_group(name, reason, timeout=timeout, other_slices=True)
            master, world = self.sup.group_master(name), sum(len(local) for _, local in slices)
            for node, local in slices[1:]:
                ranks = [f"{name}.{len(handles) + i}" for i in range(len(local))]
                remote = self.remotes[node]
                if (node, name) in self._fresh_slices:
                    first = 1 + max(self._incarnations.get(r, 0) for r in ranks)
                    handles += remote.spawn_group(name, cls, *args, gpus=local, world_size=world,
                                                  first_rank=len(handles), master=master, first_incarnation=first,
                                                  **kwargs)
                    self._fresh_slices.discard((node, name))
                else:
                    remote.respawn_group(name, reason, master, timeout=timeout)
                    handles += [ActorHandle(r, cls.__name__, endpoints_of(cls), self.sup.caller) for r in ranks]
        return handles

    def lost(self) -> dict[int, NodeLost]:
        """{node: its NodeLost} of the nodes lost so far."""
        return {rank: r.failure for rank, r in self.remotes.items() if r.failure is not None}

    def call_back(self, rank: int, timeout_s: float) -> None:
        """Wait up to `timeout_s` for lost node `rank` to join again (its launcher started again,
        by hand or by the scheduler: runtime.rendezvous.call_back), and connect to its new agent.
        Its roles are not started: `respawn` them, and `respawn_group` the rank groups that had a
        slice there. Raises RendezvousFailed, or NodeLost when the new agent does not answer."""
        old = self.remotes[rank]
        assert old.failure is not None and self._rendezvous is not None and self._keys is not None
        entry = call_back(self._rendezvous, rank, self._rendezvous.nodes[0], timeout_s)
        old.close("the node was lost")
        new = RemoteNode(self.sup, entry, self._keys, secret=self._rendezvous.secret, run=self._rendezvous.run,
                         hello_timeout_s=timeout_s)
        new.restarts.update(old.restarts)  # the run's restart counts go on
        self._incarnations.update(old.roles())
        self.remotes[rank] = new
        self._fresh_slices |= {(rank, g) for g, (*_, slices) in self._group_specs.items()
                               if any(node == rank for node, _ in slices)}

    def respawn(self, name: str, timeout: float = 60.0) -> ActorHandle:
        """Spawn role `name` again, as it was, on its node that came back (`call_back`): a new
        incarnation, past the last one the lost node ran."""
        cls, args, kwargs = self._specs[name]
        return self.remotes[self.node_of(name)].spawn(name, cls, *args, timeout=timeout,
                                                      first_incarnation=self._incarnations.get(name, 0) + 1, **kwargs)

    def publish(self, event: str, **fields) -> None:
        self.sup.publish(event, **fields)

    def check(self) -> None:
        """Raise SupervisionFailed (node 0's supervisor gave up) or the NodeLost of a lost node."""
        self.sup.check()
        for remote in self.remotes.values():
            remote.check()

    def shutdown(self, reason: str = "the run ended") -> None:
        """Tell every node to stop its roles, then stop node 0's."""
        if self._closed:
            return
        self._closed = True
        try:
            for remote in self.remotes.values():
                remote.close(reason)
        finally:
            try:
                self.sup.shutdown()
            finally:
                self._rendezvous = None
