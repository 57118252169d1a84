"""The launcher's part in a job across nodes (docs/multinode.md).

A node other than 0 (`run_node`) meets the others in node 0's store, then runs its node agent
(runtime.agent) until node 0 stops the job or is lost. Node 0 (`connect_nodes`) serves the
store (or joins torchrun's), meets the others and opens a RemoteNode to each; `node0_supervisor`
wraps them and node 0's own supervisor into the one supervisor the driver places roles through
(runtime.cluster).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ppo.config import PPOConfig
from ppo.config.cluster import job_secret, uses_agent_store
from ppo.gpu.placement import plan_placement
from ppo.gpu.sizing import FAKE_GPU_BYTES
from runtime import Supervisor
from runtime.agent import NodeAgent, RemoteNode
from runtime.cluster import ClusterSupervisor
from runtime.curve import KeyPair, numeric, route_to
from runtime.rendezvous import NodeEntry, Rendezvous, meet


def node_address(cfg: PPOConfig) -> str:
    """Where this node's sockets bind, as an IP address (libzmq binds no host names): --node-ip,
    else this node's address on the route to node 0. ValueError when it does not resolve."""
    assert cfg.cluster.master_addr, "validate() requires --master-addr with --nnodes > 1"
    return numeric(cfg.cluster.node_ip) if cfg.cluster.node_ip else route_to(cfg.cluster.master_addr)


def run_node(cfg: PPOConfig, environ: Mapping[str, str]) -> str:
    """Serve as node `--node-rank` (> 0) of the job; returns why it stopped, one line. Raises
    RendezvousFailed when the nodes do not meet, ValueError for an unresolvable address or no
    job secret in `environ`."""
    c, plan = cfg.cluster, plan_placement(cfg)
    secret = job_secret(environ, c.nnodes)
    assert c.nnodes and c.node_rank and c.master_addr, "validate() requires them on a node > 0"
    per_node = plan.num_gpus_per_node
    # SIGTERM (scancel, a node's shutdown) stops the roles through serve()'s finally. Slurm's
    # --signal=USR1@T reaches every task: node 0 saves the checkpoint and stops the job, so here
    # it must not take the default action (the process ends, and node 0 loses the node mid-save)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    while True:
        agent = NodeAgent(c.node_rank, KeyPair.new(), node_address(cfg),
                          Path(cfg.logging.run_dir) / f"node{c.node_rank}", gpus=range(per_node),
                          fake_gpus=per_node if plan.fake_gpus else 0, fake_gpu_bytes=FAKE_GPU_BYTES)
        try:
            rdv = meet(c.master_addr, c.master_port, nnodes=c.nnodes, entry=agent.entry(), secret=secret,
                       timeout_s=c.rendezvous_timeout_s, host=False, on_node_0=agent.admit)  # node 0 serves the store
        except BaseException:
            agent.close()
            raise
        why = agent.serve(rdv.nodes[0].public_key, hello_timeout_s=c.rendezvous_timeout_s, secret=secret,
                          run=rdv.run, superseded=rdv.superseded)
        if why is not None:
            return why
        # this node met an earlier start's node 0 (the store outlived it: torchrun's), whose hello
        # never comes; the new node 0 has opened its epoch since
        print(f"tandem: node {c.node_rank}: the node 0 met in epoch {rdv.epoch} is of an earlier start of the job; "
              "meeting the new one", file=sys.stderr, flush=True)


@dataclass
class Nodes:
    """Node 0's view of the other nodes: a RemoteNode per node rank > 0. The store (in
    `rendezvous`) serves while this object lives; `keys` are node 0's, which the agents admit."""

    rendezvous: Rendezvous
    remotes: dict[int, RemoteNode]
    keys: KeyPair

    def check(self) -> None:
        """Raise the NodeLost of the first node lost."""
        for remote in self.remotes.values():
            remote.check()

    def close(self, reason: str) -> None:
        for remote in self.remotes.values():
            remote.close(reason)


def connect_nodes(cfg: PPOConfig, sup: Supervisor, environ: Mapping[str, str]) -> Nodes:
    """Node 0: meet the other nodes and open a RemoteNode to each. `sup` is node 0's supervisor,
    made with transport="tcp", host=node_address(cfg) and the job's key pair. Raises
    RendezvousFailed, or NodeLost when a node does not answer node 0's hello; ValueError
    without the job's secret in `environ`."""
    c = cfg.cluster
    assert c.nnodes and c.node_rank == 0 and c.master_addr, "validate() requires them on node 0"
    keys = KeyPair.new()  # node 0's own: the agents admit it on their channels
    rdv = meet(c.master_addr, c.master_port, nnodes=c.nnodes, entry=NodeEntry(0, sup.control_endpoint, keys.public),
               secret=job_secret(environ, c.nnodes), timeout_s=c.rendezvous_timeout_s,
               host=not uses_agent_store(environ))
    remotes: dict[int, RemoteNode] = {}
    try:
        for entry in rdv.nodes[1:]:
            remotes[entry.rank] = RemoteNode(sup, entry, keys, secret=rdv.secret, run=rdv.run,
                                             hello_timeout_s=c.rendezvous_timeout_s)
    except BaseException:
        Nodes(rdv, remotes, keys).close("node 0 could not reach every node")
        raise
    return Nodes(rdv, remotes, keys)


def node0_supervisor(cfg: PPOConfig, run_dir: Path, environ: Mapping[str, str]) -> Supervisor | ClusterSupervisor:
    """The driver's supervisor: on one host a Supervisor of every GPU; across nodes node 0's own
    (tcp with the job's CURVE keys, its node's GPUs) and a RemoteNode to every other node, met
    through the rendezvous (RendezvousFailed, NodeLost when they do not meet)."""
    plan = plan_placement(cfg)
    fake, per_node = plan.fake_gpus, plan.num_gpus_per_node
    if (cfg.cluster.nnodes or 1) == 1:
        num_gpus = per_node * plan.num_nodes
        return Supervisor(run_dir, gpus=range(num_gpus), fake_gpus=num_gpus if fake else 0,
                          fake_gpu_bytes=FAKE_GPU_BYTES)
    sup = Supervisor(run_dir, transport="tcp", host=node_address(cfg), job_keys=KeyPair.new(),
                     gpus=range(per_node), fake_gpus=per_node if fake else 0, fake_gpu_bytes=FAKE_GPU_BYTES)
    try:
        nodes = connect_nodes(cfg, sup, environ)
    except BaseException:
        sup.shutdown()
        raise
    return ClusterSupervisor(sup, nodes.remotes, per_node, rendezvous=nodes.rendezvous, keys=nodes.keys)
