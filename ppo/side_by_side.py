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
holds a role to its share while the other idles), each share checked first to compute right: at some shares cuBLAS leaves
GEMM outputs unwritten without an error (roles.gemm_check). `choose` is the launcher's: where
MPS cannot start or a share fails the check it says so in one line and the run is the
synchronous colocated plan, the same config without --train-async. On
fake GPUs (the CPU computes: no SMs) that is the launcher's answer too; `ppo.loop.train`, given a
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
from ppo.placement import Placement
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


GEMM_CHECK_TIMEOUT_S = 180.0
Check = Callable[[mps.MpsDaemon, list[int]], str | None]


def check_shares(daemon: mps.MpsDaemon, percentages: list[int]) -> str | None:
    """Run roles.gemm_check in an MPS client at each share, all at once (each pays a CUDA
    start and a cuBLAS load, not timed on the GPU yet); why the first share that fails cannot be used, or None when all pass."""
    shares = sorted(set(percentages))
    what = f"checking bf16 GEMMs in MPS clients at {', '.join(f'{p}%' for p in shares)} of the SMs"
    print(f"[startup] {what} ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    procs = {p: subprocess.Popen([sys.executable, "-m", "roles.gemm_check"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**os.environ, **daemon.client_env(percentage=p)})
             for p in shares}
    results = {}
    for p, proc in procs.items():
        try:
            results[p] = proc.communicate(timeout=GEMM_CHECK_TIMEOUT_S) + (proc.returncode,)
        except subprocess.TimeoutExpired:
            proc.kill()
            results[p] = ("", f"no answer in {GEMM_CHECK_TIMEOUT_S:.0f} s", -9)
    print(f"[startup] {what}: done in {time.monotonic() - start:.2f} s", file=sys.stderr, flush=True)
    for p, (out, err, rc) in results.items():
        if rc == 0:
            continue
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            return f"the GEMM check in an MPS client at {p}% of the SMs failed (exit {rc}): {err.strip()[-300:]}"
        if "unwritten" not in report:
            return f"the GEMM check in an MPS client at {p}% of the SMs could not run: {report.get('error')}"
        m, k, n = report["unwritten"][0]
        return (f"under MPS at {p}% of the SMs ({report['sms']} SMs) cuBLAS left the output of "
                f"{len(report['unwritten'])} of {report['checked']} bf16 GEMMs unwritten (the first: "
                f"{m}x{k} @ {k}x{n}), so a role there would compute wrong results (roles.gemm_check; on the H200 60 and "
                f"75% fail, 25, 50, 90 and 100% pass): choose other --engine-sm-percentage / "
                f"--trainer-sm-percentage")
    return None


def choose(cfg: PPOConfig, check: Check = check_shares) -> SmPartition | None:
    """The launcher's decision for a side-by-side config: MPS found or started, and each role's
    SM share checked to compute right (`check`), or the synchronous colocated plan with the one
    line that says why (`fallback`). None for any other config."""
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
            why = check(daemon, [p.engine_sm_percentage, p.trainer_sm_percentage])
            if why is None:
                return SmPartition(cfg=cfg, daemon=daemon, fallback=None)
            daemon.stop()
    return SmPartition(cfg=ensure_valid(override(cfg, train_async=False)), daemon=None,
                       fallback=f"{why}: running the synchronous colocated plan (--colocate without --train-async)")
