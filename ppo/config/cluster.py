"""Which node of a multi-node job this launcher is (docs/multinode.md).

The same `python launch.py ...` runs once per node. Its node count, node rank and node 0's
address come from the flags (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`),
else from the environment of the launcher that started it:

- torchrun (`torchrun --nnodes N --nproc-per-node 1 launch.py ...`) gives each worker
  GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
  (torch/distributed/elastic/agent/server/local_elastic_agent.py, `_start_workers`); scripts
  in the manner of Megatron-LM's and torchtitan's set NNODES and NODE_RANK themselves.
- Slurm (`srun python launch.py ...`, one task per node) gives each task of the step
  SLURM_STEP_NUM_TASKS, SLURM_PROCID and SLURM_STEP_NODELIST, whose first host (`scontrol show
  hostnames`) is node 0, unless the sbatch script exported MASTER_ADDR (and MASTER_PORT), as
  scripts written for torch.distributed do. The task id, not SLURM_NODEID, is the node rank,
  so that `srun -n2` on one machine is two nodes (tests). Only a step's variables count: an
  sbatch script that runs `python launch.py` itself has SLURM_NTASKS (often one per GPU) and
  SLURM_PROCID=0 too, and is one host.

Under `srun torchrun ...` torchrun is the launcher that started this process and its ranks
win; the two only contradict each other when they count different nodes.

A job of more than one node also needs its secret, TANDEM_JOB_SECRET, the same on every node
(`job_secret`): the nodes sign their rendezvous entries with it (runtime.signing). It is read
from the environment only, never a flag, so that it shows in no command line, config dump or
resume command.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from typing import Any

from ppo.config.schema import PPOConfig
from runtime.signing import MIN_SECRET_CHARS, SECRET_ENV, JobSecret


def from_environment(env: Mapping[str, str],
                     hostnames: Callable[[str], list[str]] | None = None) -> dict[str, Any]:
    """The cluster fields (flat config names) that `env` gives; {} outside Slurm and torchrun.
    `hostnames` expands a Slurm node list (default: `scontrol show hostnames`). Raises
    ValueError, one line, when the environment contradicts itself."""
    slurm, torchrun = _slurm(env, hostnames or scontrol_hostnames), _torchrun(env)
    if slurm.get("nnodes") and torchrun.get("nnodes") and slurm["nnodes"] != torchrun["nnodes"]:
        raise ValueError(f"Slurm starts {slurm['nnodes']} tasks (SLURM_STEP_NUM_TASKS) but torchrun counts "
                         f"{torchrun['nnodes']} nodes: run one torchrun per node "
                         "(srun --ntasks-per-node=1 torchrun --nnodes $SLURM_NNODES ...) or pass --nnodes")
    return {**slurm, **torchrun}


def job_secret(env: Mapping[str, str], nnodes: int) -> JobSecret:
    """The job's secret for a job of `nnodes` > 1 nodes, with the scheduler's job id (Slurm's,
    else torchrun's run id, else none) that its signatures cover. ValueError, one line that
    says how to set it, when it is missing or too short."""
    value = env.get(SECRET_ENV, "")
    if len(value) < MIN_SECRET_CHARS:
        what = "is not set" if not value else f"has {len(value)} characters, fewer than {MIN_SECRET_CHARS}"
        raise ValueError(f"--nnodes {nnodes}: {SECRET_ENV} {what}. Export one secret, the same on every node, "
                         f"before the launchers start: in an sbatch script `export {SECRET_ENV}=$(openssl rand "
                         "-hex 32)` before srun; under torchrun or by hand, generate it once and export it on "
                         "each node. The nodes sign their rendezvous entries with it (docs/multinode.md)")
    return JobSecret(value.encode(), env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or "")


def uses_agent_store(env: Mapping[str, str]) -> bool:
    """torchrun already serves a TCPStore at MASTER_ADDR:MASTER_PORT (its agent's); every node,
    node 0 too, joins it as a client instead of hosting one."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def scontrol_hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list (`node[01-02]`) as host names, by `scontrol show hostnames`."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ValueError(f"cannot expand SLURM_STEP_NODELIST={nodelist!r} with `scontrol show hostnames` "
                         f"({e}): pass --master-addr") from None
    return out.split()


def cluster_problems(cfg: PPOConfig, num_placed_nodes: int) -> list[str]:
    """The rules between the cluster fields and the placement, which needs `num_placed_nodes`."""
    c, out = cfg.cluster, []
    if c.nnodes is None:
        for name in ("node_rank", "master_addr", "node_ip"):
            if getattr(c, name) is not None:
                out.append(f"--{name.replace('_', '-')} {getattr(c, name)} (cluster.{name}) is set but --nnodes "
                           "is not. Please add --nnodes N (the nodes of the job)")
        return out
    if c.node_rank is None:
        out.append(f"--nnodes {c.nnodes} (cluster.nnodes) is set but --node-rank is not. Please add "
                   f"--node-rank R with 0 <= R < {c.nnodes}, one per launcher")
    elif c.node_rank >= c.nnodes:
        out.append(f"--node-rank {c.node_rank} (cluster.node_rank): must be < --nnodes {c.nnodes}")
    if c.nnodes > 1 and c.master_addr is None:
        out.append("--master-addr (cluster.master_addr) is not set and neither Slurm nor torchrun gave it. "
                   "Please add --master-addr HOST (node 0's address)")
    if c.nnodes != num_placed_nodes:
        out.append(f"--nnodes {c.nnodes} (cluster.nnodes): the placement uses {num_placed_nodes} node(s) of "
                   f"--num-gpus-per-node {cfg.placement.num_gpus_per_node}. Please start {num_placed_nodes} "
                   "node(s), or change --actor-num-nodes, --actor-num-gpus-per-node or --rollout-num-gpus")
    for name in ("master_addr", "node_ip"):
        if getattr(c, name) in ("0.0.0.0", "::", "*"):
            out.append(f"--{name.replace('_', '-')} {getattr(c, name)} (cluster.{name}): a wildcard address would "
                       "bind every interface. Please give this node's address on the job's network")
    return out


def _slurm(env: Mapping[str, str], hostnames: Callable[[str], list[str]]) -> dict[str, Any]:
    if "SLURM_PROCID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
        return {}  # salloc's shell or an sbatch script outside srun: not a task of a step
    out: dict[str, Any] = {"nnodes": _int(env, "SLURM_STEP_NUM_TASKS"), "node_rank": _int(env, "SLURM_PROCID")}
    if "MASTER_ADDR" in env:  # exported by the sbatch script, as many do for torch.distributed
        out["master_addr"] = env["MASTER_ADDR"]
    elif nodelist := env.get("SLURM_STEP_NODELIST"):
        if hosts := hostnames(nodelist):
            out["master_addr"] = hosts[0]
    if "MASTER_PORT" in env:
        out["master_port"] = _int(env, "MASTER_PORT")
    return out


def _torchrun(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "NNODES" in env:
        out["nnodes"] = _int(env, "NNODES")
    elif "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env and "GROUP_RANK" in env:
        out["nnodes"] = _int(env, "WORLD_SIZE") // max(1, _int(env, "LOCAL_WORLD_SIZE"))
    for var in ("GROUP_RANK", "NODE_RANK"):  # GROUP_RANK: the rank torchrun's rendezvous assigned
        if var in env:
            out["node_rank"] = _int(env, var)
            break
    if out and "MASTER_ADDR" in env:
        out["master_addr"] = env["MASTER_ADDR"]
    if out and "MASTER_PORT" in env:
        out["master_port"] = _int(env, "MASTER_PORT")
    return out


def _int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ValueError(f"{var}={env[var]!r} in the environment: expected an integer") from None
