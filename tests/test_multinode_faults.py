"""Faults of tiny_ppo across nodes on 127.0.0.1 (tests/test_multinode_ppo.py's launchers):
the last node's launcher killed mid-run (node 1 of two, node 2 of three) stops the run on node 0
within a few heartbeats with one line and the resume command, the other nodes stop, and no role
of any node is left behind; SIGUSR1 to every launcher (Slurm's
`--signal=USR1@T` reaches every task) gives one checkpoint, and both launchers end."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.test_multinode_ppo import free_port, launch, launch_nodes, spawned, stop

LONG = ["--num-rollout", "50", "--no-check-weight-update-equal"]


def wait_for_metrics(run_dir: Path, lines: int, procs, within_s: float) -> None:
    until = time.monotonic() + within_s
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < until:
        if path.exists() and len(path.read_text().splitlines()) >= lines:
            return
        assert all(p.poll() is None for p in procs), "a launcher ended early"
        time.sleep(0.2)
    raise AssertionError(f"no {lines} rollout(s) within {within_s} s")


def last_line(log: Path) -> str:
    lines = [x for x in log.read_text().splitlines() if x.startswith("tandem:")]
    return lines[-1] if lines else ""


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("nnodes", "killed"), [(2, 1), (3, 2)])
def test_a_node_killed_mid_run_stops_the_run_with_one_line_and_the_resume_command(tmp_path, nnodes, killed):
    port, run_dir, save = free_port(), tmp_path / "run", tmp_path / "ckpt"
    procs = launch_nodes(nnodes, port, run_dir, tmp_path, LONG, node_0_extra=["--save", str(save), "--save-interval", "1"])
    node0 = procs[0]
    try:
        wait_for_metrics(run_dir, 1, procs, 300)
        roles = spawned(run_dir / f"node{killed}")
        os.kill(procs[killed].pid, signal.SIGKILL)  # the launcher: its node agent and supervisor
        t0 = time.monotonic()
        assert node0.wait(60) == 1
        took = time.monotonic() - t0
        for rank, proc in enumerate(procs[1:], 1):  # every node but the killed one was told to stop
            if rank != killed:
                assert proc.wait(30) == 0, (tmp_path / f"node{rank}.log").read_text()[-3000:]
                assert "node 0 stopped the job" in last_line(tmp_path / f"node{rank}.log")
    finally:
        stop(*procs)
    line = last_line(tmp_path / "node0.log")
    assert line.startswith(f"tandem: node {killed} lost: no heartbeat for") and "the run stopped on every node" in line
    assert line.endswith(f"Start every node again with --load {save}")
    # noticed within the heartbeat timeout (5 heartbeats of 1 s), plus the shutdown's grace
    assert took < 5 + 15, took
    time.sleep(1)
    roles |= spawned(run_dir)  # node 0's roles, and those the other nodes' agents told it of
    assert not [p for p in roles.values() if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigusr1_on_every_node_gives_one_checkpoint_and_ends_both(tmp_path):
    port, run_dir, save = free_port(), tmp_path / "run", tmp_path / "ckpt"
    node1 = launch(1, port, run_dir, tmp_path / "node1.log", LONG)
    node0 = launch(0, port, run_dir, tmp_path / "node0.log", [*LONG, "--save", str(save)])
    try:
        wait_for_metrics(run_dir, 1, (node0, node1), 200)
        for p in (node0, node1):
            os.kill(p.pid, signal.SIGUSR1)
        assert node0.wait(120) == 128 + signal.SIGUSR1, (tmp_path / "node0.log").read_text()[-3000:]
        assert node1.wait(30) == 0
    finally:
        stop(node0, node1)
    latest = (save / "latest").read_text().strip()
    steps = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert latest == f"rollout_{steps - 1:05d}"  # the last rollout that ran, saved once
    assert sorted(os.listdir(save)) == ["latest", latest]
    assert (save / latest / "model.safetensors").exists() and (tmp_path / "ckpt_critic" / latest).is_dir()
    assert f"--load {save}" in last_line(tmp_path / "node0.log")
    assert "node 0 stopped the job" in last_line(tmp_path / "node1.log")


def wait_for_text(log: Path, text: str, within_s: float) -> None:
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        if text in log.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log.name} within {within_s} s: {log.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_lost_node_started_again_resumes_the_run_from_the_newest_checkpoint(tmp_path):
    port, run_dir, save = free_port(), tmp_path / "run", tmp_path / "ckpt"
    again = ["--num-rollout", "4", "--no-check-weight-update-equal"]
    node1 = launch(1, port, run_dir, tmp_path / "node1.log", again)
    node0 = launch(0, port, run_dir, tmp_path / "node0.log",
                   [*again, "--save", str(save), "--save-interval", "1", "--max-trainer-restarts", "1"])
    node1_again = None
    try:
        wait_for_metrics(run_dir, 2, (node0, node1), 200)  # a checkpoint of this run exists
        os.kill(node1.pid, signal.SIGKILL)
        wait_for_text(tmp_path / "node0.log", "waiting up to", 30)
        node1_again = launch(1, port, run_dir, tmp_path / "node1_again.log", again)  # by hand, as a requeue would
        assert node0.wait(240) == 0, (tmp_path / "node0.log").read_text()[-5000:]
        assert node1_again.wait(30) == 0, (tmp_path / "node1_again.log").read_text()[-3000:]
    finally:
        stop(*(p for p in (node0, node1, node1_again) if p is not None))
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rewinds = [e for e in events if e["event"] == "rewind"]
    assert len(rewinds) == 1 and rewinds[0]["trainer_restarts"] == 1
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # the rewound steps ran again, once each
    # the new node's roles are later incarnations than the lost one's
    back = [e for e in events if e["event"] == "spawned" and e.get("node") == 1 and e["incarnation"] > 0]
    assert {e["role"] for e in back} == {"actor.1", "critic.1", "rollout-1"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_rank_killed_on_node_1_restarts_its_group_on_both_nodes_and_the_run_resumes(tmp_path):
    """Every node lives: ppo.recovery restarts the trainer groups across the nodes
    (ClusterSupervisor.respawn_group) and resumes from the newest checkpoint."""
    port, run_dir, save = free_port(), tmp_path / "run", tmp_path / "ckpt"
    again = ["--num-rollout", "4", "--no-check-weight-update-equal"]
    procs = launch_nodes(2, port, run_dir, tmp_path, again,
                         node_0_extra=["--save", str(save), "--save-interval", "1", "--max-trainer-restarts", "1"])
    try:
        wait_for_metrics(run_dir, 2, procs, 300)  # a checkpoint of this run exists
        os.kill(spawned(run_dir / "node1")["actor.1"], signal.SIGKILL)
        assert procs[0].wait(300) == 0, (tmp_path / "node0.log").read_text()[-5000:]
        assert procs[1].wait(30) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        stop(*procs)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    rewinds = [e for e in events if e["event"] == "rewind"]
    assert len(rewinds) == 1 and rewinds[0]["role"] == "actor.1" and rewinds[0]["trainer_restarts"] == 1
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]  # the rewound steps ran again, once each
    # both groups restarted on both nodes, node 1's by its own supervisor (its node lived)
    restarted = {(e["role"], e.get("node") or 0) for e in events if e["event"] == "restarted" and e["incarnation"] == 1}
    assert restarted == {("actor.0", 0), ("critic.0", 0), ("actor.1", 1), ("critic.1", 1)}
    assert "node 0 stopped the job" in last_line(tmp_path / "node1.log")
