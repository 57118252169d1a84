"""tiny_ppo across two nodes on 127.0.0.1: two `launch.py --nnodes 2 --node-rank R` processes
(docs/multinode.md). Node 0 runs the driver, a reward scorer and rank 0 of the actor and the
critic and engine 0 on its fake GPU; node 1's agent runs rank 1 of the actor and the critic and
engine 1 on its own. The trainers are one gloo group per role across the two nodes; batches,
calls and weight buckets to engine 1 cross over tcp with CURVE. The sockets node 1 listens on
refuse a peer without the job's keys."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import zmq

from runtime.curve import KeyPair
from tests.test_curve import handshake

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))},
       "PYTHONPATH": str(REPO)}
# tiny_ppo's layout (actor and critic on 2 fake GPUs, 2 engines, colocated), one GPU per node
TWO_NODES = ["--num-gpus-per-node", "1", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--nnodes", "2",
             "--master-addr", "127.0.0.1", "--rendezvous-timeout-s", "90"]
SMALL = ["--num-rollout", "2", "--rollout-batch-size", "16", "--eval-prompt-data", "none", "--eval-interval", "none",
         "--check-weight-update-equal", "--num-reward-workers", "1", "--log-format", "plain"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(rank: int, port: int, run_dir: Path, log: Path, extra: list[str] = ()) -> subprocess.Popen:
    with open(log, "w") as out:  # a file: the roles write there too, and nobody would drain a pipe
        return subprocess.Popen([sys.executable, "launch.py", *TWO_NODES, "--node-rank", str(rank), "--master-port",
                                 str(port), "--run-dir", str(run_dir), *SMALL, *extra],
                                cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(10)


def spawned(run_dir: Path) -> dict[str, int]:
    """{role: pid} from a run dir's events."""
    path = run_dir / "events.jsonl"
    if not path.exists():
        return {}
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {e["role"]: e["pid"] for e in events if e["event"] == "spawned"}


def listening_ports(pid: int) -> list[int]:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return []
    return [c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_ppo_runs_across_two_nodes_over_curve(tmp_path):
    port, run_dir = free_port(), tmp_path / "run"
    node1 = launch(1, port, run_dir, tmp_path / "node1.log")
    node0 = launch(0, port, run_dir, tmp_path / "node0.log")
    try:
        # while it runs: node 1's roles listen on tcp, and a stranger's handshake is refused
        until, ports = time.monotonic() + 180, []
        while not ports and time.monotonic() < until and node0.poll() is None:
            roles = spawned(run_dir / "node1")
            if "rollout-1" in roles:
                ports = listening_ports(roles["rollout-1"])
            time.sleep(0.2)
        assert ports, f"engine 1 on node 1 never listened: {(tmp_path / 'node0.log').read_text()[-3000:]}"
        ctx = zmq.Context()
        try:
            for p in ports:
                endpoint = f"tcp://127.0.0.1:{p}"
                # the stranger guesses a server key (the job's is in no store) or speaks plaintext
                for client in (KeyPair.new(), None):
                    sock, event = handshake(ctx, client, KeyPair.new().public, endpoint)
                    assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
                    sock.close()
        finally:
            ctx.term()
        assert node0.wait(240) == 0, (tmp_path / "node0.log").read_text()[-5000:]
        assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        stop(node0, node1)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    assert "train/pg_loss" in metrics[1]  # the actor trained across the nodes (step 0 warms the critic up)
    # engine 1 on node 1 runs the actor's policy: its weights came over tcp, and its log-probs agree
    assert all(m["rollout/log_probs_diff"] < 1e-4 for m in metrics)
    on_node_1 = {e["role"] for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
                 if e["event"] == "spawned" and e.get("node") == 1}
    assert on_node_1 == {"actor.1", "critic.1", "rollout-1"}
    assert "node 0 stopped the job" in (tmp_path / "node1.log").read_text()
