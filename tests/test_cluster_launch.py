"""Which node a launcher is: flags, Slurm's and torchrun's environment (ppo.config.cluster),
the rules between them and the placement, and `launch.py --dry-run` showing every node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppo.config import validate
from ppo.config.cli import build_parser, parse_cli
from ppo.config.cluster import from_environment, uses_agent_store

REPO = Path(__file__).resolve().parents[1]
TWO_NODES = ["--recipe", "qwen3_4b_ppo", "--hf-checkpoint", "/m", "--prompt-data", "/d",
             "--actor-num-nodes", "2", "--num-gpus-per-node", "4"]


def hosts(nodelist: str) -> list[str]:
    assert nodelist == "gpu[07-08]"  # what scontrol would expand
    return ["gpu07", "gpu08"]


def test_slurm_task_id_is_the_node_rank_and_the_first_host_is_node_0():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
           "SLURM_STEP_NODELIST": "gpu[07-08]"}
    assert from_environment(env, hosts) == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu07"}


def test_an_sbatch_scripts_exported_master_wins_over_the_node_list():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "12345"}
    assert from_environment(env, hosts) == {"nnodes": 2, "node_rank": 0, "master_addr": "10.0.0.7",
                                            "master_port": 12345}


def test_slurm_outside_an_srun_step_gives_nothing():
    # an sbatch script running launch.py itself: one task per GPU asked for, but one host
    batch = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "1", "SLURM_NTASKS": "8", "SLURM_PROCID": "0",
             "SLURM_JOB_NODELIST": "gpu07"}
    assert from_environment(batch, hosts) == {}


def test_torchrun_group_rank_and_master():
    env = {"GROUP_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29400", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert from_environment(env, hosts) == {"nnodes": 2, "node_rank": 1, "master_addr": "n0",
                                            "master_port": 29400}
    assert uses_agent_store(env) and not uses_agent_store({})


def test_torchrun_inside_srun_wins_on_rank():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
           "GROUP_RANK": "1", "NNODES": "2", "MASTER_ADDR": "gpu08"}
    assert from_environment(env, hosts) == {"nnodes": 2, "node_rank": 1, "master_addr": "gpu08"}


def test_slurm_and_torchrun_counting_different_nodes_is_one_line():
    with pytest.raises(ValueError) as err:
        from_environment({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4", "NNODES": "2", "NODE_RANK": "0"}, hosts)
    assert "\n" not in str(err.value) and "SLURM_STEP_NUM_TASKS" in str(err.value)


def test_a_garbled_variable_names_itself():
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        from_environment({"SLURM_PROCID": "x", "SLURM_STEP_NUM_TASKS": "2"}, hosts)


def test_flags_win_over_the_scheduler():
    cfg, _ = parse_cli(build_parser(), TWO_NODES + ["--node-rank", "0"],
                       scheduler={"nnodes": 2, "node_rank": 1, "master_addr": "gpu07"})
    assert (cfg.cluster.nnodes, cfg.cluster.node_rank, cfg.cluster.master_addr) == (2, 0, "gpu07")


def test_cluster_rules_name_flag_value_and_fix():
    cfg, _ = parse_cli(build_parser(), TWO_NODES + ["--nnodes", "2", "--node-rank", "0", "--master-addr", "h"])
    assert validate(cfg) == []
    from ppo.config import override
    problems = validate(override(cfg, nnodes=3, node_rank=3, node_ip="0.0.0.0"))
    assert any(p.startswith("--node-rank 3 (cluster.node_rank): must be < --nnodes 3") for p in problems)
    assert any("the placement uses 2 node(s)" in p for p in problems)
    assert any(p.startswith("--node-ip 0.0.0.0") and "wildcard" in p for p in problems)
    assert any("--node-rank 1 (cluster.node_rank) is set but --nnodes is not" in p
               for p in validate(override(cfg, nnodes=None, node_rank=1, master_addr=None)))


def launch(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
             and k not in ("NNODES", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True, text=True,
                          env={**clean, "PYTHONPATH": str(REPO), **env}, timeout=60)


def test_dry_run_shows_every_node_from_torchrun_environment():
    out = launch(TWO_NODES + ["--dry-run"], {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.0.5"})
    assert out.returncode == 0, out.stderr
    assert "node 0: driver, 1 reward worker(s), rendezvous store at 10.1.0.5:29500, actor [0-3]" in out.stdout
    assert "node 1 (this one): actor [0-3], critic [0-3], engine 4 [0]" in out.stdout


def test_contradicting_schedulers_exit_2_with_one_line():
    out = launch(["--dry-run"], {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3", "NNODES": "2", "NODE_RANK": "0"})
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith("tandem: Slurm starts 3 tasks")


def test_a_host_name_for_node_ip_binds_its_address():
    from ppo.setup.nodes import node_address

    cfg, _ = parse_cli(build_parser(), TWO_NODES + ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                                    "--node-ip", "localhost"])
    assert node_address(cfg) == "127.0.0.1"
    cfg, _ = parse_cli(build_parser(), TWO_NODES + ["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1"])
    assert node_address(cfg) == "127.0.0.1"  # the route to node 0
