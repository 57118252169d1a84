"""The driver's part in the weight sync to engines on other nodes (roles.weight_broadcast):
which engines take their weights by broadcast, and the group they and the actor's rank 0 join
through a store that node 0's driver hosts."""

from __future__ import annotations

from dataclasses import dataclass

from runtime import gather
from runtime.rendezvous import host_store


@dataclass
class WeightBroadcast:
    by_broadcast: list[bool]  # per engine: on another node than the actor's rank 0
    store: object  # the group's TCPStore, served while this lives


def open_weight_broadcast(job) -> WeightBroadcast | None:
    """Make the actor's rank 0 and every engine on another node one broadcast group (gloo on
    fake GPUs, NCCL on GPUs); None when every engine is on the actor's node. Called again after
    such an engine restarted: its new incarnation is in no group, so all of them join a new one."""
    plan = job.placement
    home = plan.node_of(plan.actor_gpus[0])
    remote = [plan.node_of(gpus[0]) != home for gpus in plan.engines]
    if not any(remote):
        return None
    world = 1 + sum(remote)
    store = host_store(job.sup.sup.host, world)  # the ClusterSupervisor's node 0 address
    backend = "gloo" if plan.fake_gpus else "nccl"
    host, port = job.sup.sup.host, store.port
    # where the group meets: c10d's store listens on every interface (docs/multinode.md), and a
    # check of a node's sockets tells it from the job's own by this port
    job.sup.publish("weight_group", world=world, backend=backend, master=[host, port])
    members = [e for e, r in zip(job.engines, remote) if r]
    gather([job.actor.join_weight_group.call(host, port, world, backend)]
           + [e.join_weight_group.call(host, port, world, rank, backend) for rank, e in enumerate(members, 1)])
    return WeightBroadcast(remote, store)
