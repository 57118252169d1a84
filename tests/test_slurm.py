"""tiny_ppo across two nodes under a real Slurm on this host (tests/slurm.py): an sbatch script in
the manner of examples/slurm/qwen3_4b_ppo_2nodes.sbatch runs `srun -n2 --kill-on-bad-exit=1 python
launch.py ...`, whose two tasks take their node rank and node 0 from srun's environment;
`scancel --signal=USR1` reaches both tasks and node 0 saves one checkpoint and stops the job; the
job requeued (`scontrol requeue`, what --requeue does after a preemption) runs the script again,
which resumes with --load and finishes. Skips, saying why, where Slurm cannot run."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest

from tests import slurm as one_host
from tests.test_multinode_ppo import REPO, free_port

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    started = one_host.start(tmp_path_factory.mktemp("slurm"))
    if isinstance(started, str):
        pytest.skip(started)
    yield started
    started.stop()


def job_state(slurm, job: str) -> str:
    return re.search(r"JobState=(\S+)", slurm.run("scontrol", "show", "job", job, "-o")).group(1)


def wait_for(what: str, check, within_s: float) -> None:
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} within {within_s} s")


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_srun_tasks_read_their_node_rank_and_node_0_from_slurm(slurm):
    code = ("import json, os; from ppo.config.cluster import from_environment; "
            "print(json.dumps(from_environment(os.environ)))")
    out = slurm.run("srun", "--overcommit", "-n2", sys.executable, "-c", code, timeout=60, cwd=REPO)
    host = slurm.run("hostname", "-s").strip()  # the first (only) host of SLURM_STEP_NODELIST, by scontrol
    tasks = sorted((json.loads(line) for line in out.splitlines()), key=lambda t: t["node_rank"])
    assert tasks == [{"nnodes": 2, "node_rank": r, "master_addr": host} for r in (0, 1)]


@pytest.mark.slow
def test_srun_launchers_dry_run_each_its_node(slurm):
    out = slurm.run("srun", "--overcommit", "-n2", sys.executable, "launch.py", "--num-gpus-per-node", "1",
                    "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--dry-run", timeout=240, cwd=REPO)
    host = slurm.run("hostname", "-s").strip()  # the first (only) host of SLURM_STEP_NODELIST
    assert f"rendezvous store at {host}:29500" in out
    assert "node 0 (this one): driver" in out and "node 1 (this one): actor [0], critic [0], engine 1 [0]" in out


@pytest.mark.slow
def test_srun_runs_two_nodes_usr1_saves_and_a_requeue_resumes(slurm, tmp_path):
    save, runs = tmp_path / "ckpt", tmp_path / "run"
    script = tmp_path / "job.sbatch"
    script.write_text(f"""#!/bin/bash
#SBATCH --ntasks=2 --overcommit --requeue --output={tmp_path}/job-%j.out
set -euo pipefail
cd {REPO}
export PYTHONPATH={REPO} MASTER_PORT={free_port()}
# one secret per job, as the example makes it: srun hands it to both tasks
export TANDEM_JOB_SECRET=$({sys.executable} -c "import secrets; print(secrets.token_hex(32))")
srun --kill-on-bad-exit=1 --overcommit -n2 {sys.executable} launch.py --num-gpus-per-node 1 \\
  --actor-num-nodes 2 --actor-num-gpus-per-node 1 --num-rollout 3 --rollout-batch-size 16 \\
  --eval-prompt-data none --eval-interval none --num-reward-workers 1 --log-format plain \\
  --rendezvous-timeout-s 120 --save {save} --load {save} --run-dir {runs}
""")
    job = slurm.run("sbatch", "--parsable", str(script)).strip()
    first = second = runs  # a resumed run logs on in its run dir (the --save folder remembers it)
    wait_for("the first rollout under way", lambda: (first / "metrics.jsonl").exists(), 400)
    slurm.run("scancel", "--signal=USR1", job)  # what --signal=USR1@T sends every task
    wait_for("the job's end after the checkpoint", lambda: job_state(slurm, job) in ("FAILED", "COMPLETED"), 200)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert "tandem: SIGUSR1: saved rollout_" in out and "resume with:" in out, out[-3000:]
    latest = (save / "latest").read_text().strip()
    saved = [e for e in events(first) if e["event"] == "checkpoint"]
    assert len(saved) == 1 and latest == f"rollout_{saved[0]['step']:05d}"  # one checkpoint, the one named

    slurm.run("scontrol", "requeue", job)
    slurm.run("scontrol", "update", f"jobid={job}", "starttime=now")  # a requeued job waits otherwise
    wait_for("the requeued job's end", lambda: job_state(slurm, job) in ("COMPLETED", "FAILED"), 500)
    assert job_state(slurm, job) == "COMPLETED", (tmp_path / f"job-{job}.out").read_text()[-3000:]
    resumed = [e for e in events(second) if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] == saved[0]["step"]
    steps = [json.loads(x)["step"] for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps[-1] == 2  # it went on to --num-rollout
