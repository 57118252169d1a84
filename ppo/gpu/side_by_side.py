"""Side by side on one GPU (--train-async --colocate): each shared GPU's memory budgets, and
its SMs shared between the roles under MPS.

Memory. Each GPU an engine shares with the trainers is split into two budgets, each with a
lease of its own (runtime.memory.LeaseTable.split): the engine's, --sglang-mem-fraction-static
of the GPU (sglang's meaning: weights and KV cache), which it holds from its spawn on and never
gives up; and the trainers' (the rest), which the actor and the critic take in turn as they do
a whole GPU colocated, keeping their weights and moving only their optimizer state
(--offload-train-level optimizer). An engine that dies still holds its budget, so its restart
never waits on the trainers.

SMs. Under MPS each role process gets a share of the SMs (--engine-sm-percentage,
--trainer-sm-percentage) and the trainers a scheduling priority against the engine's
(--trainer-mps-priority; by default 100/100 with the trainers below_normal: a static split
holds a role to its share while the other idles), each role's client checked first to compute
right: at some shares cuBLAS leaves GEMM outputs unwritten without an error (roles.compute_check).
`choose` is the launcher's: where MPS cannot start or a role's client fails the check it says so
in one line and the run is the synchronous colocated plan, the same config without
--train-async. On fake GPUs (the CPU computes: no SMs) that is the launcher's answer too; `ppo.loop.train`, given a
side-by-side config and no partition, runs side by side without one (the CPU tests of the
budgets and the loop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ppo import config as C
from ppo.config import PPOConfig
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.gpu.placement import Placement
from runtime import mps
from runtime.budget import Budget

ENGINE_BUDGET, TRAINER_BUDGET = "engine", "trainers"


def memory_budgets(cfg: PPOConfig, plan: Placement, capacity: int) -> dict[int, list[Budget]]:
    """{gpu: its budgets} for every GPU an engine shares with the trainers (all of them, side
    by side); `capacity`: one GPU's bytes."""
    engine = int(cfg.engine.sglang_mem_fraction_static * capacity)
    trainers = ("actor", "critic") if plan.critic_gpus else ("actor",)
    return {g: [Budget(name=ENGINE_BUDGET, nbytes=engine, holders=(f"rollout-{i}",)),
                Budget(name=TRAINER_BUDGET, nbytes=capacity - engine, holders=trainers)]
            for i, gpus in enumerate(plan.engines) for g in gpus if g in plan.actor_gpus}


@dataclass(frozen=True, kw_only=True)
class SmPartition:
    """The run's SM split: `daemon` gives each role its share; None where there is none
    (`fallback` then says why the run is the synchronous plan)."""
    cfg: PPOConfig  # the config to run
    daemon: mps.MpsDaemon | None
    fallback: str | None

    def role_env(self) -> dict[str, dict[str, str]]:
        """{"engine": env, "trainer": env} for the role processes; {} without a daemon."""
        if self.daemon is None:
            return {}
        p = self.cfg.placement
        return {"engine": self.daemon.client_env(percentage=p.engine_sm_percentage),
                "trainer": self.daemon.client_env(percentage=p.trainer_sm_percentage,
                                                  priority=p.trainer_mps_priority)}

    def event(self) -> dict:
        """The `sm_partition` event's fields."""
        p = self.cfg.placement
        return {"mps": self.daemon is not None, "started_daemon": bool(self.daemon and self.daemon.started),
                "engine_sm_percentage": p.engine_sm_percentage if self.daemon else None,
                "trainer_sm_percentage": p.trainer_sm_percentage if self.daemon else None,
                "trainer_mps_priority": p.trainer_mps_priority if self.daemon else None,
                "fallback": self.fallback}

    def close(self) -> None:
        """Stop the daemon if we started it."""
        if self.daemon is not None:
            self.daemon.stop()


CHECK_SECONDS = 5.0  # each role's check repeats this long, so that the clients' checks overlap
CHECK_TIMEOUT_S = 180.0
Check = Callable[[dict[str, dict[str, str]]], str | None]


def _client(env: dict[str, str]) -> str:
    """'100% of the SMs, below_normal': a role's MPS client, from its environment."""
    priority = {v: k for k, v in mps.PRIORITIES.items()}[env["CUDA_MPS_CLIENT_PRIORITY"]]
    return f"{env['CUDA_MPS_ACTIVE_THREAD_PERCENTAGE']}% of the SMs, {priority}"


def check_roles(envs: dict[str, dict[str, str]]) -> str | None:
    """Run roles.compute_check in each role's MPS client (`envs`: SmPartition.role_env), all at
    once and for CHECK_SECONDS each, so that each runs beside the other as the roles will (each
    also pays a CUDA start and a cuBLAS load); why the first role's client that computes wrong
    cannot be used, or None when all compute right."""
    clients = ", ".join(f"{role} at {_client(env)}" for role, env in envs.items())
    what = f"checking GEMMs and the onload copy in the roles' MPS clients ({clients})"
    print(f"[startup] {what} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    procs = {role: subprocess.Popen([sys.executable, "-m", "roles.compute_check", "--seconds", str(CHECK_SECONDS)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, **env})
             for role, env in envs.items()}
    results = {}
    for role, proc in procs.items():
        try:
            results[role] = proc.communicate(timeout=CHECK_TIMEOUT_S) + (proc.returncode,)
        except subprocess.TimeoutExpired:
            proc.kill()
            results[role] = ("", f"no answer in {CHECK_TIMEOUT_S:.0f} s", -9)
    print(f"[startup] {what}: done in {time.monotonic() - start:.2f} s", file=sys.stderr, flush=True)
    for role, (out, err, rc) in results.items():
        why = verdict(f"the {role}'s MPS client ({_client(envs[role])})", out, err, rc)
        if why is not None:
            return why
    return None


def verdict(where: str, out: str, err: str, rc: int) -> str | None:
    """Why the client `where` cannot be used, from its roles.compute_check run (standard output
    and error, exit code); None when it computed right."""
    if rc == 0:
        return None
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return f"the compute check in {where} failed (exit {rc}): {err.strip()[-300:]}"
    if "wrong" not in report:
        return f"the compute check in {where} could not run: {report.get('error')}"
    wrong = [f"{len(report['wrong'])} bf16 GEMMs"] if report["wrong"] else []
    wrong += [f"{len(report['copy'])} onload copies"] if report["copy"] else []
    first = ""
    if report["wrong"]:
        layout, m, k, n = report["wrong"][0]
        first = f" (the first: the {layout} GEMM of a linear of {m} x {k} -> {n})"
    return (f"in {where} ({report['sms']} SMs) {' and '.join(wrong)} of {report['checked']} checks came out "
            f"wrong{first}, so the role would compute wrong results (roles.compute_check; on the H200 cuBLAS left "
            f"forward GEMMs unwritten at 60 and 75% of the SMs, where 25, 50, 90 and 100% passed alone): choose "
            f"other --engine-sm-percentage / --trainer-sm-percentage / --trainer-mps-priority")


def choose(cfg: PPOConfig, check: Check = check_roles) -> SmPartition | None:
    """The launcher's decision for a side-by-side config: MPS found or started, and each role's
    client (its SM share and priority) checked to compute right (`check`), or the synchronous
    colocated plan with the one line that says why (`fallback`). None for any other config."""
    if not C.side_by_side(cfg):
        return None
    p = cfg.placement
    if p.fake_gpus:
        why = "side by side needs MPS to split the GPU's SMs and fake GPUs have none to split"
    else:
        try:
            daemon = mps.find_or_start()
        except mps.MpsUnavailable as e:
            why = f"side by side needs MPS to split the GPU's SMs and it cannot start ({e})"
        else:
            partition = SmPartition(cfg=cfg, daemon=daemon, fallback=None)
            why = check(partition.role_env())
            if why is None:
                return partition
            daemon.stop()
    return SmPartition(cfg=ensure_valid(override(cfg, train_async=False)), daemon=None,
                       fallback=f"{why}: running the synchronous colocated plan (--colocate without --train-async)")
