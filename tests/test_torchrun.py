"""tiny_ppo under a real torchrun (torch.distributed.run), two agents on 127.0.0.1 with the c10d
rendezvous backend, one launcher per node as docs/multinode.md shows: the launchers take their
node rank, node count and node 0 from torchrun's environment and meet in its agent's store,
signed under the job's secret. With --max-restarts 1, node 1's launcher killed mid-run: torchrun
restarts both launchers, which meet again on the same store (a new epoch: the earlier start's
entries are still there) and resume from the newest checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.test_multinode_ppo import ENV, REPO, SMALL, free_port, read_metrics, stop


def torchrun(port: int, run_dir: Path, ckpt: Path, log: Path) -> subprocess.Popen:
    """One node's torchrun agent; no --nnodes, --node-rank or --master-* for launch.py."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "tandem-test", "launch.py", "--num-gpus-per-node", "1", "--actor-num-nodes", "2",
               "--actor-num-gpus-per-node", "1", "--rendezvous-timeout-s", "90", "--run-dir", str(run_dir),
               *SMALL, "--num-rollout", "5", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "1"]
    with open(log, "w") as out:
        return subprocess.Popen(command, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def launchers(agents: list[subprocess.Popen]) -> dict[int, psutil.Process]:
    """{node rank: process} of the launchers that the torchrun `agents` started (their children;
    GROUP_RANK in their environment)."""
    found = {}
    for agent in agents:
        for p in psutil.Process(agent.pid).children():
            try:
                if "launch.py" in p.cmdline():
                    found[int(p.environ()["GROUP_RANK"])] = p
            except (psutil.Error, KeyError):
                continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_ppo_under_torchrun_restarts_both_launchers_and_resumes(tmp_path):
    port, run_dir, ckpt = free_port(), tmp_path / "run", tmp_path / "ckpt"
    agents = [torchrun(port, run_dir, ckpt, tmp_path / f"agent{i}.log") for i in range(2)]
    logs = lambda: "\n".join((tmp_path / f"agent{i}.log").read_text()[-3000:] for i in range(2))  # noqa: E731
    try:
        until = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert time.monotonic() < until and all(a.poll() is None for a in agents), logs()
            time.sleep(0.2)
        first = launchers(agents)
        assert sorted(first) == [0, 1], first
        first[1].kill()  # node 1's launcher dies: its agent restarts it, node 0's agent restarts node 0's
        for agent in agents:
            assert agent.wait(300) == 0, logs()
    finally:
        stop(*agents)
    metrics = read_metrics(run_dir)
    # every rollout logged once, the ones after the restart from the checkpoint (resume drops the rest)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    assert [m["rollout/weight_version"] for m in metrics] == [0, 1, 2, 3, 4]
    assert "train/pg_loss" in metrics[-1]
    # the second start ran: node 0's launcher wrote a second event log, node 1's kept its first folder
    assert (run_dir / "events.1.jsonl").exists() and (run_dir / "node1.before-1").is_dir()
    starts = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    assert any(e["event"] == "spawned" and e["role"] == "rollout-1" for e in starts)
