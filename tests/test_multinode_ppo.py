"""tiny_ppo across two and three nodes on 127.0.0.1: one `launch.py --nnodes N --node-rank R`
process per node (docs/multinode.md). Node 0 runs the driver, a reward scorer and rank 0 of the
actor and the critic and engine 0 on its fake GPU; node R's agent runs rank R of the actor and
the critic and engine R on its own. The trainers are one gloo group per role across the nodes;
batches, calls and weight buckets to the other nodes' engines cross over tcp with CURVE. The
last node refuses a peer without the job's keys (its agent by the ZAP handler, though the
stranger read the agent's public key from the store); in network namespaces every node's
sockets, IPv4 and IPv6, are bound to its own address, c10d's stores on node 0 apart; and every
metric but the times is that of one node with the same layout (N fake GPUs on one host)."""

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

from tests.netns import Namespaces, NetnsUnavailable, listeners

REPO = Path(__file__).resolve().parents[1]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))},
       "PYTHONPATH": str(REPO), "TANDEM_JOB_SECRET": "the job's secret, 32 characters!"}
# 96 samples a rollout (12 prompts x 8), which 2 and 3 data-parallel ranks share evenly
SMALL = ["--num-rollout", "2", "--rollout-batch-size", "12", "--global-batch-size", "96", "--micro-batch-size", "16",
         "--eval-prompt-data", "none", "--eval-interval", "none", "--check-weight-update-equal",
         "--num-reward-workers", "1", "--log-format", "plain"]


def on_nodes(nnodes: int, master_addr: str = "127.0.0.1") -> list[str]:
    """tiny_ppo's layout (actor and critic on every fake GPU, an engine per GPU, colocated) with one
    GPU per node."""
    return ["--num-gpus-per-node", "1", "--actor-num-nodes", str(nnodes), "--actor-num-gpus-per-node", "1",
            "--nnodes", str(nnodes), "--master-addr", master_addr, "--rendezvous-timeout-s", "90"]


def on_one_node(num_gpus: int) -> list[str]:
    """The same layout on one host of `num_gpus` fake GPUs."""
    return ["--num-gpus-per-node", str(num_gpus), "--actor-num-gpus-per-node", str(num_gpus)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(rank: int, port: int, run_dir: Path, log: Path, extra: list[str] = (), nnodes: int = 2,
           prefix: list[str] = (), master_addr: str = "127.0.0.1") -> subprocess.Popen:
    """Node `rank`'s launcher; `prefix` runs it inside something (`ip netns exec NS`)."""
    command = [*prefix, sys.executable, "launch.py", *on_nodes(nnodes, master_addr), "--node-rank", str(rank),
               "--master-port", str(port), "--run-dir", str(run_dir), *SMALL, *extra]
    with open(log, "w") as out:  # a file: the roles write there too, and nobody would drain a pipe
        return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def launch_nodes(nnodes: int, port: int, run_dir: Path, logs: Path, extra: list[str] = (),
                 node_0_extra: list[str] = (), ns: Namespaces | None = None) -> list[subprocess.Popen]:
    """Every node's launcher, node 0 last (the others wait for it in the rendezvous); in rank order.
    With `ns`, each inside its node's network namespace, node 0 at its address there."""
    def start(rank: int, more: list[str]) -> subprocess.Popen:
        where = {"prefix": ns.prefix(rank), "master_addr": ns.address(0)} if ns else {}
        return launch(rank, port, run_dir, logs / f"node{rank}.log", more, nnodes, **where)
    others = [start(r, extra) for r in range(1, nnodes)]
    return [start(0, [*extra, *node_0_extra]), *others]


def run_one_node(num_gpus: int, run_dir: Path, log: Path) -> list[dict]:
    """The same run on one host (no cluster flags); its metrics."""
    with open(log, "w") as out:
        subprocess.run([sys.executable, "launch.py", *on_one_node(num_gpus), "--run-dir", str(run_dir), *SMALL],
                       cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT, timeout=240, check=True)
    return read_metrics(run_dir)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def computed(metrics: dict) -> dict:
    """A rollout's metrics without the times (perf/*), which differ run to run."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


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


def strangers_refused(store: tuple[str, int], rank: int, endpoints: list[str], prefix: list[str] = ()) -> bool:
    """Whether node `rank` refuses a stranger, from a process run with `prefix` (another node's
    network namespace). Its agent's channel, dialled with the agent's real public key, which the
    stranger reads from the rendezvous store at `store` (open to whoever reaches it), and a client
    key not in the job: the agent's ZAP handler refuses the handshake (EVENT_HANDSHAKE_FAILED_AUTH).
    Every endpoint (the roles' mailboxes, whose server key is the job's and in no store): a client
    with a key of its own guessing a server key, and a plaintext one, never finish a handshake."""
    script = """if True:
        import json, sys, zmq
        import torch.distributed as dist
        from runtime.curve import KeyPair
        from tests.test_curve import handshake, handshake_succeeds
        addr, port, rank, *endpoints = sys.argv[1:]
        store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False)
        agent = json.loads(store.get(f"tandem/1/node/0/{rank}/1"))  # the node's entry: epoch 1, generation 0, slot 1
        ctx = zmq.Context()
        sock, event = handshake(ctx, KeyPair.new(), agent["public_key"].encode(), agent["endpoint"])
        assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH, (agent["endpoint"], event)
        sock.close()
        for endpoint in [agent["endpoint"], *endpoints]:
            for client in (KeyPair.new(), None):
                assert not handshake_succeeds(ctx, client, KeyPair.new().public, endpoint), endpoint
        ctx.term()"""
    out = subprocess.run([*prefix, sys.executable, "-c", script, store[0], str(store[1]), str(rank), *endpoints],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return True


def store_ports(run_dir: Path, master_port: int) -> set[int]:
    """The ports of c10d's stores that node 0 serves: the job's rendezvous store (--master-port),
    each rank group's (the MASTER_PORT its ranks were given) and the weight broadcast group's (its
    `weight_group` event)."""
    ports = {master_port}
    for pid in spawned(run_dir).values():
        try:
            if "MASTER_PORT" in (env := psutil.Process(pid).environ()):
                ports.add(int(env["MASTER_PORT"]))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    return ports | {e["master"][1] for e in events if e["event"] == "weight_group"}


def stray_listeners(procs: list[subprocess.Popen], ns: Namespaces, run_dir: Path, master_port: int) -> tuple[int, list]:
    """Every socket, IPv4 and IPv6, listening in a node's namespace on another address than the
    node's own (a wildcard, loopback), but c10d's stores on node 0, which listen on every
    interface and are told apart by their ports (`store_ports`). Returns (the stores seen on a
    wildcard, the strays as (node, address, port)); a node whose launcher ended is skipped."""
    bound = {}
    for rank, proc in enumerate(procs):
        try:
            bound[rank] = listeners(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
    stores = store_ports(run_dir, master_port)
    stray = [(r, a, p) for r, pairs in bound.items() for a, p in pairs
             if a != ns.address(r) and not (r == 0 and p in stores)]
    if stray:  # a store made between the reading of the sockets and of the ports: read them again
        time.sleep(1)
        stores = store_ports(run_dir, master_port)
        stray = [(r, a, p) for r, a, p in stray if not (r == 0 and p in stores)]
    return sum(1 for a, p in bound.get(0, ()) if p in stores and a in ("0.0.0.0", "::")), stray


@pytest.fixture(scope="module")
def one_node_metrics(tmp_path_factory):
    """metrics(num_gpus): those of the one-host run of that many fake GPUs, run once per module."""
    runs: dict[int, list[dict]] = {}

    def metrics(num_gpus: int) -> list[dict]:
        if num_gpus not in runs:
            where = tmp_path_factory.mktemp(f"one_node_{num_gpus}")
            runs[num_gpus] = run_one_node(num_gpus, where / "run", where / "one_node.log")
        return runs[num_gpus]
    return metrics


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("nnodes", "netns"), [(2, False), (3, False), (2, True)],
                         ids=["2-loopback", "3-loopback", "2-netns"])
def test_tiny_ppo_runs_across_nodes_over_curve_as_on_one_node(tmp_path, nnodes, netns, one_node_metrics):
    """On 127.0.0.1, or each node in a network namespace of its own (tests/netns.py) so that node
    0 is reached at a non-loopback address, as on separate hosts."""
    ns = node_namespaces(nnodes) if netns else None
    port, run_dir, last = free_port(), tmp_path / "run", nnodes - 1
    try:
        procs = launch_nodes(nnodes, port, run_dir, tmp_path, ns=ns)
        node0_log = tmp_path / "node0.log"
        try:
            # while it runs: the last node's roles listen on tcp, and a stranger's handshake is refused
            until, endpoints = time.monotonic() + 300, []
            while not endpoints and time.monotonic() < until and procs[0].poll() is None:
                roles = spawned(run_dir / f"node{last}")
                if f"rollout-{last}" in roles:
                    pid = roles[f"rollout-{last}"]
                    if ns is None:
                        endpoints = [f"tcp://127.0.0.1:{p}" for p in listening_ports(pid)]
                    else:  # every socket of the node's namespace
                        endpoints = [f"tcp://{a}:{p}" for a, p in listeners(pid) if a == ns.address(last)]
                time.sleep(0.2)
            assert endpoints, f"engine {last} on node {last} never listened: {node0_log.read_text()[-3000:]}"
            # from node 0's namespace: a peer on another host
            store = (ns.address(0) if ns else "127.0.0.1", port)
            assert strangers_refused(store, last, endpoints, ns.prefix(0) if ns else [])
            # every node's sockets, until the run ends: each bound to its node's address, but c10d's stores
            stores_seen = snapshots = 0
            while ns is not None and procs[0].poll() is None:
                seen, stray = stray_listeners(procs, ns, run_dir, port)
                assert not stray, f"sockets not bound to their node's address (node, address, port): {stray}"
                stores_seen, snapshots = max(stores_seen, seen), snapshots + 1
                time.sleep(0.5)
            assert ns is None or (snapshots and stores_seen), "no snapshot saw node 0's stores listening"
            assert procs[0].wait(300) == 0, node0_log.read_text()[-5000:]
            for rank, proc in enumerate(procs[1:], 1):
                assert proc.wait(30) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
        finally:
            stop(*procs)
    finally:
        if ns is not None:
            ns.close()
    check_ran_across(run_dir, tmp_path, nnodes)
    # the same layout on one host computes the same numbers: the nodes change only where ranks run
    assert [computed(m) for m in read_metrics(run_dir)] == [computed(m) for m in one_node_metrics(nnodes)]


def node_namespaces(nnodes: int) -> Namespaces:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    try:
        return Namespaces(nnodes)
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")


def check_ran_across(run_dir: Path, logs: Path, nnodes: int) -> None:
    """The run of `nnodes` launchers trained the actor, and every other node ran its ranks and engine."""
    metrics = read_metrics(run_dir)
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1]
    assert "train/pg_loss" in metrics[1]  # the actor trained across the nodes (step 0 warms the critic up)
    # the other nodes' engines run the actor's policy: their weights came over tcp, and their log-probs agree
    assert all(m["rollout/log_probs_diff"] < 1e-4 for m in metrics)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    for rank in range(1, nnodes):
        on_node = {e["role"] for e in events if e["event"] == "spawned" and e.get("node") == rank}
        assert on_node == {f"actor.{rank}", f"critic.{rank}", f"rollout-{rank}"}
        assert "node 0 stopped the job" in (logs / f"node{rank}.log").read_text()
