"""A launcher on a node other than 0 (--node-rank > 0): meet the others in node 0's store, then
run this node's agent (runtime.agent) until node 0 stops the job or is lost. What node 0's
driver does across nodes is not built yet (docs/multinode.md)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from ppo.config import PPOConfig
from ppo.gpu.placement import FAKE_GPU_BYTES, plan_placement
from runtime.agent import NodeAgent
from runtime.curve import KeyPair, route_to
from runtime.rendezvous import meet


def run_node(cfg: PPOConfig) -> str:
    """Serve as node `--node-rank` (> 0) of the job; returns why it stopped, one line. Raises
    RendezvousFailed when the nodes do not meet, ValueError for an unresolvable address."""
    c, plan = cfg.cluster, plan_placement(cfg)
    assert c.nnodes and c.node_rank and c.master_addr, "validate() requires them on a node > 0"
    host = c.node_ip or route_to(c.master_addr)  # the scheduler's network, never a wildcard
    per_node = plan.num_gpus_per_node
    agent = NodeAgent(c.node_rank, KeyPair.new(), host, Path(cfg.logging.run_dir) / f"node{c.node_rank}",
                      gpus=range(per_node), fake_gpus=per_node if plan.fake_gpus else 0,
                      fake_gpu_bytes=FAKE_GPU_BYTES)
    # SIGTERM (scancel, a node's shutdown) stops the roles through serve()'s finally
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        rdv = meet(c.master_addr, c.master_port, nnodes=c.nnodes, entry=agent.entry(),
                   timeout_s=c.rendezvous_timeout_s, host=False)  # node 0 hosts it
    except BaseException:
        agent.close()
        raise
    return agent.serve(rdv.nodes[0].public_key, hello_timeout_s=c.rendezvous_timeout_s)
