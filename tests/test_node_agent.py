"""The node agent's channel in one process (runtime.agent): a NodeAgent serving in a thread,
node 0's RemoteNode beside it, both on 127.0.0.1 with their own CURVE keys. What the two-launcher
test (tests/test_multinode.py) cannot show cheaply: a clean stop, node 0 going silent, and a
node 0 without the job's key, which the agent never lets in."""

from __future__ import annotations

import threading
import time

import msgpack
import psutil
import pytest
import zmq
from rich.console import Console

from runtime import Actor, ActorDied, Supervisor, endpoint
from runtime.agent import NodeAgent, RemoteNode
from runtime.curve import KeyPair, dial
from runtime.events import read_events
from runtime.monitor import MonitorState, render
from runtime.rendezvous import NodeEntry
from runtime.signing import JobSecret
from tests.actors import Echo

HEARTBEAT_S = 0.1
SECRET, RUN = JobSecret(b"the job's secret, 32 characters!"), "run-1"  # what the rendezvous hands both sides
pytestmark = pytest.mark.timeout(60)


class Serving:
    """A NodeAgent (node 1 unless told) whose serve() runs in a thread; `.reason` once it returned."""

    def __init__(self, tmp_path, driver_key: bytes, hello_timeout_s: float = 10.0, rank: int = 1, superseded=None):
        self.agent = NodeAgent(rank, KeyPair.new(), "127.0.0.1", tmp_path / f"node{rank}", fake_gpus=1)
        self.reason: str | None = None
        self.thread = threading.Thread(target=self._serve, args=(driver_key, hello_timeout_s, superseded), daemon=True)
        self.thread.start()

    def _serve(self, driver_key, hello_timeout_s, superseded):
        self.reason = self.agent.serve(driver_key, hello_timeout_s, secret=SECRET, run=RUN, superseded=superseded)

    def wait(self, timeout: float) -> str | None:
        self.thread.join(timeout)
        return self.reason


def gone(pid: int, within_s: float) -> bool:
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_roles_call_across_nodes_until_node_0_stops_the_job(tmp_path):
    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S) as sup:
        remote = RemoteNode(sup, node1.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
        echo = remote.spawn("echo", Echo, gpus=[0])
        assert echo.ping([1, 2]) == [1, 2]
        near = sup.spawn("near", Echo)
        # a handle passed as an argument carries its address: roles call across nodes both ways
        assert echo.call_peer(near, 7) == 7 and near.call_peer(echo, 8) == 8
        pid = echo.pid()
        # node 1's role events reach node 0's bus, so the monitor attached at node 0 shows it
        state = MonitorState()
        until = time.monotonic() + 10
        while state.roles.get("echo") is None or state.roles["echo"].state != "ready":
            assert time.monotonic() < until, "node 1's role events did not reach node 0's bus"
            time.sleep(0.1)
            state = MonitorState()
            for event in read_events(tmp_path / "node0"):
                state.apply(event)
        assert (state.roles["echo"].node, state.roles["echo"].pid) == (1, pid)
        assert state.roles["near"].node is None
        console = Console(record=True, width=160)
        console.print(render(state, "node0"))
        cells = [[c.strip() for c in line.split("│")] for line in console.export_text().splitlines()]
        rows = {c[1]: c[2] for c in cells if len(c) > 2 and c[1] in ("echo", "near")}
        assert rows == {"echo": "1", "near": "0"}  # the node column, there only across nodes
        remote.close("done")
        assert node1.wait(10) == "node 0 stopped the job: done"
    assert gone(pid, 5)


def monitor_at(run_dir, until_true, within_s: float = 10) -> MonitorState:
    """The monitor's state from `run_dir`'s events, read again until `until_true(state)`."""
    until = time.monotonic() + within_s
    while True:
        state = MonitorState()
        for event in read_events(run_dir):
            state.apply(event)
        if until_true(state):
            return state
        assert time.monotonic() < until, "the events did not reach node 0's bus"
        time.sleep(0.1)


def test_the_monitor_at_node_0_shows_every_nodes_roles_and_gpus(tmp_path):
    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S,
                    fake_gpus=1) as sup:
        remote = RemoteNode(sup, node1.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
        remote.spawn("far", Echo, gpus=[0])
        sup.spawn("near", Echo, gpus=[0])
        # each node's GPU 0 changes hands on its own table (the driver's ClusterLeases does this)
        sup.leases.acquire(0, "near")
        remote.lease("acquire", 0, "far")
        remote.lease("release", 0, "far", 0)
        remote.lease("acquire", 0, "far2")
        state = monitor_at(tmp_path / "node0", lambda s: s.leases.get((1, 0, ""), {}).get("holder") == "far2")
        assert state.leases[0, 0, ""]["holder"] == "near"
        assert state.gpu_bytes == {(1, 0): {"far": 0}}  # the bytes `far` left on node 1's GPU 0
        console = Console(record=True, width=160)
        console.print(render(state, "node0"))
        text = console.export_text()
        cells = [[c.strip() for c in line.split("│")] for line in text.splitlines()]
        rows = {c[1]: (c[2], c[5]) for c in cells if len(c) > 5 and c[1] in ("far", "near")}
        assert rows == {"far": ("1", "0"), "near": ("0", "0")}  # (node, gpus): each node's own GPU 0
        assert "node 0 gpu 0: lease near" in text
        assert "node 1 gpu 0: lease far2; 0 B in use: far 0 B" in text
        remote.close("done")
        assert node1.wait(10) == "node 0 stopped the job: done"


def test_node_0_silent_past_the_timeout_stops_the_node(tmp_path):
    keys, job, started_again = KeyPair.new(), KeyPair.new(), threading.Event()
    node1 = Serving(tmp_path, keys.public, superseded=started_again.is_set)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)  # node 0 as runtime.agent.RemoteNode speaks: hello, then nothing
    sock.linger = 0
    dial(sock, keys, node1.agent.keys.public, node1.agent.endpoint)
    hello = {"token": "t" * 32, "job_public": job.public, "job_secret": job.secret,
             "heartbeat_interval": HEARTBEAT_S, "heartbeat_timeout": 0.5}
    mac = SECRET.sign("hello", {"hello": hello, "run": RUN, "rank": 1})  # as RemoteNode signs it (runtime/agent.py)
    sock.send_multipart([b"hello", msgpack.packb({**hello, "mac": mac})])
    assert sock.poll(10_000) and sock.recv_multipart()[0] == b"welcome"
    started_again.set()  # a node 0 that said hello is the job's: a newer start in the store is not asked about
    started = time.monotonic()
    reason = node1.wait(10)
    assert reason == "node 0 stopped answering for 0.5 s: stopping this node's roles"
    assert time.monotonic() - started < 3
    sock.close()
    ctx.term()


def test_a_node_waiting_for_a_hello_returns_once_the_job_has_started_again(tmp_path):
    """The node 0 it met is of an earlier start (Rendezvous.superseded): serve returns None, its
    agent closed, for run_node to meet the new node 0 with a new one (ppo/setup/nodes.py)."""
    started_again = threading.Event()
    node1 = Serving(tmp_path, KeyPair.new().public, hello_timeout_s=30, superseded=started_again.is_set)
    time.sleep(1.0)
    assert node1.thread.is_alive()
    started_again.set()
    started = time.monotonic()
    node1.thread.join(5)
    assert not node1.thread.is_alive() and node1.reason is None
    assert time.monotonic() - started < 2 and node1.agent._ctx.closed


def test_a_node_0_without_the_jobs_key_is_never_let_in(tmp_path):
    node1 = Serving(tmp_path, KeyPair.new().public, hello_timeout_s=1.0)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S) as sup:
        impostor = KeyPair.new()  # not the key node 1 read from the rendezvous store
        entry = NodeEntry(1, node1.agent.endpoint, node1.agent.keys.public)
        with pytest.raises(Exception, match="node 1 .*did not answer node 0's hello|node 1 lost"):
            RemoteNode(sup, entry, impostor, secret=SECRET, run=RUN, hello_timeout_s=1.0)
    assert node1.wait(5) == "node 0 did not say hello for 1 s: stopping this node's roles"
    assert node1.agent.sup is None  # no supervisor was ever started for the impostor


@pytest.mark.parametrize("secret, run", [(JobSecret(b"another job's secret, 32 chars.."), RUN), (SECRET, "run-0")],
                         ids=["wrong-secret", "another-run"])
def test_a_hello_not_signed_for_this_job_and_run_is_refused(tmp_path, caplog, secret, run):
    """A peer that holds node 0's key (the agent admits it) but signs its hello with another
    secret, or for another run, never gets a supervisor started, and the refusal is one line."""
    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public, hello_timeout_s=1.0)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S) as sup:
        with pytest.raises(Exception, match="node 1 .*did not answer node 0's hello|node 1 lost"):
            RemoteNode(sup, node1.agent.entry(), keys, secret=secret, run=run, hello_timeout_s=1.0)
    assert node1.wait(5) == "node 0 did not say hello for 1 s: stopping this node's roles"
    assert node1.agent.sup is None
    assert [r.getMessage() for r in caplog.records if "refused a hello" in r.getMessage()] == [
        "tandem: node 1: refused a hello that is signed wrong (a peer with node 0's key but not the job's "
        "TANDEM_JOB_SECRET, or of another run)"]


@pytest.mark.parametrize("body", [["not", "a", "dict"], {"run": RUN, "rank": 1, "job": "j", "mac": "0" * 64}],
                         ids=["not-a-dict", "reserved-names"])
def test_a_malformed_hello_is_refused_and_the_agent_goes_on(tmp_path, caplog, body):
    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public, hello_timeout_s=1.0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    dial(sock, keys, node1.agent.keys.public, node1.agent.endpoint)
    sock.send_multipart([b"hello", msgpack.packb(body)])
    assert node1.wait(5) == "node 0 did not say hello for 1 s: stopping this node's roles"
    assert node1.agent.sup is None
    assert any("refused a hello that is" in r.getMessage() for r in caplog.records)
    sock.close()
    ctx.term()


def test_a_caller_without_the_jobs_key_cannot_reach_a_role(tmp_path):
    from runtime import CallTimeout, wire
    from runtime.handle import Caller

    with Supervisor(tmp_path, transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S) as sup:
        echo = sup.spawn("echo", Echo)
        assert echo.ping(1) == 1  # the driver's caller holds the job's key
        ctx = zmq.Context()
        # the wire token too: only the missing key keeps this caller out
        stranger = Caller(ctx, wire.WireConfig(token=sup.cfg.token, curve=KeyPair.new()), "stranger", sup.directory)
        try:
            with pytest.raises(CallTimeout):
                stranger.call("echo", "ping", (2,), {}, timeout=None).result(timeout=1.0)
        finally:
            stranger.close()
            ctx.term()
        assert echo.ping(3) == 3


class GlooRank(Actor):
    """A rank that joins its group as the trainers do (roles.trainer.distributed.init_from_env)."""

    def __init__(self):
        from roles.trainer.distributed import init_from_env

        self.rank = init_from_env("gloo")

    @endpoint
    def all_reduce(self, value: float) -> list:
        import os

        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)
        return [self.rank.rank, self.rank.world_size, int(os.environ["LOCAL_RANK"]), float(t.item())]


@pytest.mark.timeout(120)
def test_a_rank_group_spans_two_nodes_over_gloo(tmp_path):
    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public)
    # the default heartbeats: a rank importing torch on a busy 2-core machine misses short ones
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), fake_gpus=1) as sup:
        remote = RemoteNode(sup, node1.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
        try:
            here = sup.spawn_group("actor", GlooRank, gpus=[0], world_size=2, first_rank=0)
            there = remote.spawn_group("actor", GlooRank, gpus=[0], world_size=2, first_rank=1,
                                       master=sup.group_master("actor"))
            futures = [h.all_reduce.call(float(10 ** rank)) for rank, h in enumerate(here + there)]
            # [rank, world size, LOCAL_RANK on its node, 10**0 + 10**1 summed over both nodes]
            assert [f.result(timeout=60) for f in futures] == [[0, 2, 0, 11.0], [1, 2, 0, 11.0]]
            assert [h.name for h in here + there] == ["actor.0", "actor.1"]
        finally:
            remote.close("done")
    assert node1.wait(10) == "node 0 stopped the job: done"


def test_a_slice_of_ranks_past_the_world_size_is_refused(tmp_path):
    with Supervisor(tmp_path, transport="tcp", job_keys=KeyPair.new()) as sup:
        with pytest.raises(ValueError, match=r"ranks 1..2 do not fit a group of world_size=2"):
            sup.spawn_group("actor", Echo, gpus=[0, 1], world_size=2, first_rank=1, master=("127.0.0.1", 1))


def test_a_rank_group_across_nodes_dies_as_one_from_either_side(tmp_path):
    import os
    import signal

    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S,
                    fake_gpus=1) as sup:
        remote = RemoteNode(sup, node1.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
        try:
            slices = {}
            for group in ("left", "right"):
                here = sup.spawn_group(group, Echo, gpus=[0], world_size=2)
                there = remote.spawn_group(group, Echo, gpus=[0], world_size=2, first_rank=1,
                                           master=sup.group_master(group))
                assert here[0].ping(0) == 0 and there[0].ping(1) == 1
                slices[group] = (here[0], there[0], there[0].pid())
            here, there, pid = slices["left"]
            os.kill(pid, signal.SIGKILL)  # node 1's rank dies: node 0's rank stops with it
            with pytest.raises(ActorDied, match="left.1"):
                for _ in range(100):
                    here.ping(2, timeout=5)
                    time.sleep(0.05)
            here, there, pid = slices["right"]
            sup.kill("right.0")  # node 0's rank dies: node 1's rank stops with it
            assert gone(pid, 5)
            with pytest.raises(ActorDied):
                there.ping(3, timeout=5)
        finally:
            remote.close("done")


def test_three_nodes_a_rank_group_dies_as_one_across_all_of_them(tmp_path):
    import os
    import signal

    keys = KeyPair.new()
    agents = {rank: Serving(tmp_path / f"n{rank}", keys.public, rank=rank) for rank in (1, 2)}
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S,
                    fake_gpus=1) as sup:
        remotes = {r: RemoteNode(sup, a.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
                   for r, a in agents.items()}
        try:
            ranks = sup.spawn_group("grp", Echo, gpus=[0], world_size=3)
            for r, remote in remotes.items():
                ranks += remote.spawn_group("grp", Echo, gpus=[0], world_size=3, first_rank=r,
                                            master=sup.group_master("grp"))
            pids = [h.pid() for h in ranks]
            assert [h.name for h in ranks] == ["grp.0", "grp.1", "grp.2"]
            os.kill(pids[2], signal.SIGKILL)  # node 2's rank: node 0's and node 1's ranks stop with it
            assert gone(pids[1], 5), "node 1's rank outlived the death of node 2's"
            with pytest.raises(ActorDied, match="grp.2"):
                ranks[0].ping(0, timeout=5)
        finally:
            for remote in remotes.values():
                remote.close("done")
    assert [a.wait(10) for a in agents.values()] == ["node 0 stopped the job: done"] * 2


def test_a_rank_group_across_live_nodes_restarts_as_one_and_dies_as_one_again(tmp_path):
    """The trainers' recovery (ppo.recovery) across nodes while every node lives: rank 1 of
    `actor` on node 1 dies; `actor` and the live `critic` restart on both nodes at new
    incarnations, node 1's ranks joining node 0's new store, and die as one again after."""
    import os
    import signal

    from runtime.cluster import ClusterSupervisor

    keys = KeyPair.new()
    node1 = Serving(tmp_path, keys.public)
    with Supervisor(tmp_path / "node0", transport="tcp", job_keys=KeyPair.new(), heartbeat_interval=HEARTBEAT_S,
                    fake_gpus=1) as sup:
        remote = RemoteNode(sup, node1.agent.entry(), keys, secret=SECRET, run=RUN, hello_timeout_s=10)
        cluster = ClusterSupervisor(sup, {1: remote}, 1)
        try:
            groups = {g: cluster.spawn_group(g, Echo, gpus=[0, 1]) for g in ("actor", "critic")}
            cluster.wait_ready()
            before = {h.name: h.pid() for hs in groups.values() for h in hs}
            os.kill(before["actor.1"], signal.SIGKILL)
            with pytest.raises(ActorDied, match="actor.1"):  # node 0's rank stopped with it
                for _ in range(100):
                    groups["actor"][0].ping(0, timeout=5)
                    time.sleep(0.05)
            for g in ("actor", "critic"):
                groups[g] = cluster.respawn_group(g, "actor.1 died")
            cluster.wait_ready()
            for g, (near, far) in groups.items():
                assert (near.ping(g), far.ping(g)) == (g, g)
                assert far.env("MASTER_PORT", "RANK") == {"MASTER_PORT": str(sup.group_master(g)[1]), "RANK": "1"}
            after = {h.name: h.pid() for hs in groups.values() for h in hs}
            assert not set(after.values()) & set(before.values())  # every rank a new process
            assert all(gone(pid, 5) for pid in before.values())
            sup.kill("critic.0")  # the restarted group still dies as one across the nodes
            assert gone(after["critic.1"], 5), "node 1's new rank outlived node 0's"
            assert groups["actor"][1].ping(1) == 1  # the other group is untouched
        finally:
            cluster.shutdown("done")
    assert node1.wait(10) == "node 0 stopped the job: done"
