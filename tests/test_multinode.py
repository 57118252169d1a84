"""Two nodes on 127.0.0.1: node 0 in this process (a supervisor with the job's CURVE keys, and
ppo.setup.nodes.connect_nodes from the same command line with --node-rank 0), node 1 a `launch.py --nnodes 2 --node-rank 1` process running its node agent
(runtime.agent) on its own fake GPU. A role on node 1 is called from node 0; node 1 killed is
noticed within a few heartbeats, and no role of it outlives it. One launcher process per test
file: it imports torch (the rendezvous store), the bulk of its time. A clean stop and node 0
lost are in tests/test_node_agent.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runtime import ActorDied, RemoteError, Supervisor
from ppo.config.cli import parse_args
from ppo.setup.nodes import connect_nodes, node_address
from runtime.agent import NodeLost
from runtime.curve import KeyPair
from tests.actors import Echo

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT_S = 0.2  # the supervisors' interval; the timeout is 5 of them
pytestmark = pytest.mark.timeout(120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_1_command(run_dir: Path, port: int, timeout_s: float) -> list[str]:
    return [sys.executable, "launch.py", "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1",
            "--actor-num-nodes", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--run-dir", str(run_dir), "--rendezvous-timeout-s", str(timeout_s)]


SECRET = {"TANDEM_JOB_SECRET": "the job's secret, 32 characters!"}  # the same on every node
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "PYTHONPATH": str(REPO), **SECRET}


def start_node_1(run_dir: Path, port: int) -> subprocess.Popen:
    # a file, not a pipe: its roles write there too, and nobody would drain a pipe
    with open(run_dir / "node1.log", "w") as log:
        return subprocess.Popen(node_1_command(run_dir, port, 30), cwd=REPO, env=ENV, stderr=log,
                                start_new_session=True)


def gone(pid: int, within_s: float) -> bool:
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def two_nodes(tmp_path):
    port = free_port()
    node1 = start_node_1(tmp_path, port)
    cfg = parse_args(node_1_command(tmp_path, port, 60)[2:] + ["--node-rank", "0"])  # node 0's own line
    sup = Supervisor(tmp_path / "node0", transport="tcp", host=node_address(cfg), job_keys=KeyPair.new(),
                     heartbeat_interval=HEARTBEAT_S, fake_gpus=1)
    nodes = None
    try:
        nodes = connect_nodes(cfg, sup, environ=SECRET)
        yield sup, nodes.remotes[1], node1
    finally:
        if nodes is not None:
            nodes.close("the test ended")
        sup.shutdown()
        try:
            node1.wait(timeout=15)
        except subprocess.TimeoutExpired:  # it never met node 0: its roles die with it
            node1.kill()
            node1.wait()


def test_a_role_on_node_1_is_called_from_node_0_until_node_1_is_killed(two_nodes, tmp_path):
    sup, remote, node1 = two_nodes
    echo = remote.spawn("echo", Echo, "far", gpus=[0])
    assert echo.ping(41) == 41
    near_rank = sup.spawn_group("grp", Echo, gpus=[0], world_size=2)[0]  # a rank group across both nodes
    remote.spawn_group("grp", Echo, gpus=[0], world_size=2, first_rank=1, master=sup.group_master("grp"))
    assert echo.env("CUDA_VISIBLE_DEVICES", "TANDEM_FAKE_GPU_DIR") == {
        "CUDA_VISIBLE_DEVICES": "0", "TANDEM_FAKE_GPU_DIR": str(tmp_path / "node1" / "fakegpu")}
    with pytest.raises(RemoteError, match="boom"):  # the error contract holds across nodes
        echo.fail("boom")
    node1.send_signal(signal.SIGUSR1)  # Slurm's --signal=USR1 reaches every task; node 0's to act on
    time.sleep(2 * HEARTBEAT_S)
    assert node1.poll() is None and echo.ping("again") == "again"
    pid = echo.pid()

    node1.send_signal(signal.SIGKILL)  # the launcher alone: its roles must follow it (PR_SET_PDEATHSIG)
    killed = time.monotonic()
    while remote.failure is None and time.monotonic() - killed < 10:
        time.sleep(0.02)
    noticed = time.monotonic() - killed
    assert isinstance(remote.failure, NodeLost)
    assert noticed < sup.heartbeat_timeout + 5 * HEARTBEAT_S, noticed
    message = str(remote.failure)
    assert "\n" not in message and message.startswith("node 1 lost: no heartbeat for")
    with pytest.raises(ActorDied, match="node 1 lost"):
        echo.ping(1)
    with pytest.raises(ActorDied, match="node 1 lost"):  # node 0's slice of the group went with the node
        for _ in range(100):
            near_rank.ping(2, timeout=5)
            time.sleep(0.05)
    assert gone(pid, 5), "a role of the killed node was left behind"


def test_node_0_unreachable_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run(node_1_command(tmp_path, free_port(), 1), cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("tandem: node 1: node 0's rendezvous store at 127.0.0.1:")
    assert "did not answer within 1 s" in out.stderr


def test_a_node_without_the_jobs_secret_is_one_line_and_exit_2(tmp_path):
    env = {k: v for k, v in ENV.items() if k != "TANDEM_JOB_SECRET"}
    out = subprocess.run(node_1_command(tmp_path, free_port(), 1), cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("tandem: node 1: --nnodes 2: TANDEM_JOB_SECRET is not set. Export one secret, "
                                 "the same on every node")
    assert "export TANDEM_JOB_SECRET=$(openssl rand -hex 32)" in out.stderr


@pytest.mark.slow
def test_node_1_that_met_an_earlier_starts_node_0_serves_the_new_one(tmp_path):
    """A store that outlives its starts (torchrun's agent's): the earlier start's node 0 died before
    node 1 joined, and node 1's launcher, up before the new node 0, meets the dead one in the earlier
    start's epoch. It learns of the new start while it waits for the hello (~13 s: the launcher
    imports torch)."""
    from ppo.config.cluster import job_secret
    from runtime.rendezvous import NodeEntry, RendezvousFailed, host_store, meet

    store, secret = host_store("127.0.0.1", 2), job_secret(SECRET, 2)  # as every launcher reads it
    with pytest.raises(RendezvousFailed, match="did not join"):  # the earlier start, alone
        meet("127.0.0.1", store.port, nnodes=2, entry=NodeEntry(0, "tcp://127.0.0.1:9", KeyPair.new().public),
             secret=secret, timeout_s=0.3, host=False)
    node1 = start_node_1(tmp_path, store.port)
    deadline = time.monotonic() + 60
    while not store.check(["tandem/1/node/0/1/1"]):  # node 1 met the earlier start's node 0
        assert time.monotonic() < deadline and node1.poll() is None, (tmp_path / "node1.log").read_text()
        time.sleep(0.1)
    cfg = parse_args(node_1_command(tmp_path, store.port, 60)[2:] + ["--node-rank", "0"])
    sup = Supervisor(tmp_path / "node0", transport="tcp", host=node_address(cfg), job_keys=KeyPair.new(),
                     heartbeat_interval=HEARTBEAT_S, fake_gpus=1)
    try:
        nodes = connect_nodes(cfg, sup, environ={**SECRET, "TORCHELASTIC_USE_AGENT_STORE": "true"})
        assert nodes.rendezvous.epoch == 2
        echo = nodes.remotes[1].spawn("echo", Echo, "far", gpus=[0])
        assert echo.ping(7) == 7
        nodes.close("the test ended")
        assert node1.wait(timeout=15) == 0
    finally:
        sup.shutdown()
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    log = (tmp_path / "node1.log").read_text()
    assert "tandem: node 1: the node 0 met in epoch 1 is of an earlier start of the job; meeting the new one" in log
