"""Fault injection into a running tiny_ppo job, and the table of what it survived.

    python -m bench.faults [--json FILE] [--only NAME]

Each scenario starts a small tiny_ppo job (2 fake GPUs, real role processes), injects a
fault when the run's event log shows the moment it waits for, and reads what happened
from the same log and the sample dumps: whether the job recovered, how many samples were
lost (must be 0), how many finished rollouts a trainer recovery ran again (redone: those
after the checkpoint it went back to), the time from the fault to the supervisor seeing
it, and the time until the replacement was ready.

The chaos row kills engines and scorers several times each at seeded random moments of a
longer run (`Chaos`) and checks that the run still completes every rollout and reaches the
learning bar of tests/test_e2e_ppo.py; its times are medians (and maxima) over the kills.
The chaos-async row does the same with --train-async (engines on their own GPU, the next
rollout generating while the step trains: ASYNC), and the chaos-side row side by side (the
engine and the trainers on one GPU at once, each in its memory budget: SIDE; no MPS on fake
GPUs, which the CPU computes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.setup.job import start_job
from ppo.loop import TrainerDied, run
from ppo.config.recipes import tiny_ppo
from runtime import SupervisionFailed
from runtime.events import follow_events, read_events
from runtime.fakegpu import FakeDevice


class Injector(threading.Thread):
    """Sends `sig` to `victim` the first time `trigger(event)` holds, reading the event log;
    with `times` > 1 it fires again at each later match (a restart storm)."""

    def __init__(self, job, victim: str, trigger, *, sig: int = signal.SIGKILL, times: int = 1):
        super().__init__(daemon=True)
        self.job, self.victim, self.trigger, self.sig, self.times = job, victim, trigger, sig, times
        self.fired_at: list[float] = []
        self.stop = False

    def run(self):
        seen = 0
        while not self.stop and len(self.fired_at) < self.times:
            events = read_events(self.job.run_dir)
            for e in events[seen:]:
                if self.trigger(e) and len(self.fired_at) < self.times:
                    try:
                        self.job.sup.kill(self.victim, self.sig)
                    except (ProcessLookupError, KeyError):
                        continue
                    self.fired_at.append(time.time())
            seen = len(events)
            time.sleep(0.005)


def after_first_rollout(role: str, state: str):
    """A trigger: `role` enters lifecycle `state` once rollout 0 has been logged."""
    logged = []

    def trigger(e: dict) -> bool:
        if e["event"] == "metrics":
            logged.append(e)
        return bool(logged) and e["event"] == "state" and e["role"] == role and e["new"] == state
    return trigger


class Chaos(threading.Thread):
    """SIGKILLs each of `victims` `kills_each` times, in a seeded random order, at random
    moments once rollout 0 is logged, a few seconds apart and fewer than
    `job.sup.max_restarts` within any restart window (the restart intensity is another
    scenario's subject, not this one's).

    A moment is random within the phases where a death is recovered: a scorer at any
    time; an engine early in a generation (replaced, its requests issued again; if the
    generation is over by then, the next handoff recovers it) or while a trainer holds its
    GPU and the engine holds nothing there (its restart waits for the lease); an engine with
    a lease of its own (a GPU of its own, or side by side a budget) also while the driver is
    between a rollout and the critic's update (the handoff before the weight sync finds it dead). Not
    during a weight sync: a death inside it still stops the run (docs/reliability.md, known
    limits).
    """

    def __init__(self, job, victims: list[str], *, kills_each: int, seed: int,
                 gap_s: tuple[float, float] = (1.0, 5.0)):
        super().__init__(daemon=True)
        self.job, self.rng = job, random.Random(seed)
        self.plan = [v for v in victims for _ in range(kills_each)]
        self.gap_s = gap_s  # seconds between kills, drawn uniformly from this range
        self.rng.shuffle(self.plan)
        self.kills: list[tuple[str, int, float]] = []  # (victim, incarnation killed, time.time())
        self.moments: list[str] = []  # per kill: "scorer", "engine generating", "engine, trainer on its GPU"
        self.stop = False

    def run(self):
        engine_gpu = {t.name: t.gpus[0] for t in self.job.engine_tenants}
        # an engine on a GPU of its own, or side by side in a budget of its own, never takes turns with a trainer
        own_lease = {t.name: not self.job.colocation.shares_lease(t, self.job.actor_tenant)
                     for t in self.job.engine_tenants}
        driver_phase = None  # the driver's phase begun last
        devices = {name: FakeDevice(self.job.sup.fake_gpu_dir, g) for name, g in engine_gpu.items()}
        generating_since: dict[str, float] = {}  # engine -> ts of its `generating` event
        logged, next_ok = False, 0.0
        for e in follow_events(self.job.run_dir, poll_s=0.005):
            if self.stop or not self.plan:
                return
            kind = e["event"]
            logged |= kind == "metrics"
            if kind == "phase" and e.get("track") == "driver" and e["action"] == "begin":
                driver_phase = e["phase"]
            if kind == "state" and e["role"] in engine_gpu:
                if e["new"] == "generating":
                    generating_since[e["role"]] = e["ts"]
                else:
                    generating_since.pop(e["role"], None)
            victim = self.plan[0]
            window = [t for _, _, t in self.kills if time.time() - t < self.job.sup.restart_window_s]
            if not logged or time.time() < next_ok or len(window) >= self.job.sup.max_restarts - 1:
                continue
            child = self.job.sup._children[victim]
            if child.state != "ready" or self.rng.random() > 0.3:
                continue  # not now: a later event is a later moment
            time.sleep(self.rng.uniform(0.0, 0.02))
            if victim in engine_gpu and not self._engine_in_window(
                    victim, engine_gpu[victim], devices[victim], generating_since.get(victim),
                    own_lease=own_lease[victim], driver_phase=driver_phase):
                continue
            try:
                self.job.sup.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append((victim, child.incarnation, time.time()))
            self.moments.append("scorer" if victim not in engine_gpu else
                                "engine generating" if victim in generating_since else
                                "engine in a lease of its own" if own_lease[victim]
                                else "engine, trainer on its GPU")
            self.plan.pop(0)
            next_ok = time.time() + self.rng.uniform(*self.gap_s)

    def _engine_in_window(self, name: str, gpu: int, device: FakeDevice, generating_since: float | None, *,
                          own_lease: bool, driver_phase: str | None) -> bool:
        """Generating (its `generating` event is under 40 ms old: a tiny_ppo generation takes
        about 70 ms), or holding nothing on its GPU while a trainer holds the lease (read
        live from the lease table and the fake device's ledger: the weight sync, where the
        actor holds the lease too, finds the engine holding its weights)."""
        if generating_since is not None:
            return time.time() - generating_since < 0.04
        if own_lease:
            return driver_phase in ("rollout", "log_probs", "values", "advantages", "critic_train")
        return self.job.sup.leases.holder(gpu) in ("actor", "critic") and device.usage(name) == 0

    def outcome(self) -> dict:
        """Per kill: detected (the `died` event of that incarnation) and recovered (the
        `ready` event of a later one), with the times from the kill."""
        events = read_events(self.job.run_dir)
        detect, recover = [], []
        for victim, inc, t in self.kills:
            died = [e["ts"] for e in events if e["event"] in ("died", "hung") and e.get("role") == victim
                    and e["incarnation"] == inc]
            ready = [e["ts"] for e in events if e["event"] == "ready" and e.get("role") == victim
                     and e["incarnation"] > inc]
            if died:
                detect.append(died[0] - t)
            if ready:
                recover.append(min(ready) - t)
        return {"kills": len(self.kills), "recovered": len(recover),
                "kills_by_role": {v: sum(k[0] == v for k in self.kills) for v in sorted({k[0] for k in self.kills})},
                "kills_by_moment": {m: self.moments.count(m) for m in sorted(set(self.moments))},
                "detect_s": statistics.median(detect) if detect else None, "detect_max_s": max(detect, default=None),
                "recover_s": statistics.median(recover) if recover else None,
                "recover_max_s": max(recover, default=None)}


def samples_lost(job, num_rollout: int, completed: bool) -> int:
    """Samples missing from (or twice in) the sample dumps; a completed run dumps them all."""
    cfg = job.cfg
    expected = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    lost = 0
    for step in range(num_rollout):
        f = job.run_dir / "samples" / f"rollout_{step:05d}.jsonl"
        if f.exists():
            indices = [json.loads(x)["index"] for x in f.read_text().splitlines()]
            lost += expected - len(set(indices)) + (len(indices) - len(set(indices)))
        elif completed:
            lost += expected
    return lost


def learning_bar(history: list[dict]) -> tuple[float, float, bool]:
    """tests/test_e2e_ppo.py's bar: the first 5 rollouts' mean reward below 0.25 (chance
    level), the last 5 at least 0.25 above it."""
    rewards = [h["rollout/raw_reward"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    return first, last, first < 0.25 and last - first >= 0.25


# --train-async on tiny_ppo's two fake GPUs: the trainers on one, the engine on the other
ASYNC = dict(train_async=True, colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1)
# --train-async side by side on one fake GPU (ppo.gpu.side_by_side)
SIDE = dict(train_async=True, colocate=True, num_gpus_per_node=1, actor_num_gpus_per_node=1,
            sglang_mem_fraction_static=0.4, offload_train_level="optimizer")
CHAOS_ROWS = {"chaos": None, "chaos-async": ASYNC, "chaos-side": SIDE}  # row name: config overrides


def run_chaos(workdir: Path, *, num_rollout: int, batch: int, kills_each: int, seed: int = 0,
              gap_s: tuple[float, float] = (1.0, 5.0), values: dict | None = None) -> dict:
    """A tiny_ppo run with engines and scorers killed at random (`Chaos`); its row.
    `values`: config overrides (CHAOS_ROWS)."""
    cfg = tiny_job_config(workdir / "run", num_rollout=num_rollout, rollout_batch_size=batch, **(values or {}))
    job = start_job(cfg)
    victims = [e.name for e in job.engines] + [s.name for s in job.scorers]
    # The kills are spread out, not a restart storm (that scenario has its own row): let the
    # run take them all even when it is short, as on a quiet machine.
    job.sup.max_restarts = max(job.sup.max_restarts, len(victims) * kills_each + 1)
    chaos = Chaos(job, victims, kills_each=kills_each, seed=seed, gap_s=gap_s)
    chaos.start()
    outcome, history = "completed", []
    try:
        history = run(job)
    except (TrainerDied, SupervisionFailed) as e:
        outcome = f"stopped: {type(e).__name__}"
    finally:
        chaos.stop = True
        job.close()
        chaos.join(timeout=10)
    first, last, reached = learning_bar(history) if len(history) >= 10 else (None, None, False)
    mode = ("" if not cfg.rollout.train_async else " (--train-async, side by side)" if cfg.placement.colocate
            else " (--train-async)")
    return {"fault": f"chaos{mode}: {', '.join(victims)} killed {kills_each}x each at random (seed {seed})",
            "outcome": outcome, "rollouts": len(history),
            "samples_lost": samples_lost(job, num_rollout, outcome == "completed"),
            "reward_first5": first, "reward_last5": last, "learning_bar": reached, **chaos.outcome()}


def tiny_job_config(run_dir: Path, **values):
    return ensure_valid(override(tiny_ppo(), run_dir=str(run_dir), **values))


SCENARIOS = {
    # name: (victim, signal, trigger state, times, config overrides)
    "engine killed mid-generation": ("rollout-0", signal.SIGKILL, ("rollout-0", "generating"), 1, {}),
    "scorer killed mid-scoring": ("reward-0", signal.SIGKILL, ("reward-0", "scoring"), 1, {}),
    "scorer hung (SIGSTOP) mid-scoring": ("reward-0", signal.SIGSTOP, ("reward-0", "scoring"), 1, {}),
    "trainer killed mid-training": ("actor.1", signal.SIGKILL, ("actor.1", "training"), 1, {}),
    # ppo.recovery: both trainers come back from the newest checkpoint ({workdir}: the scenario's folder)
    "trainer killed, recovered from checkpoint": ("actor.1", signal.SIGKILL, ("actor.1", "training"), 1, {
        "save": "{workdir}/ckpt", "save_interval": 1, "max_trainer_restarts": 1}),
    "restart storm (engine killed 5 times)": ("rollout-1", signal.SIGKILL, ("rollout-1", "generating"), 5, {}),
}


def run_scenario(name: str, workdir: Path) -> dict:
    victim, sig, (role, state), times, values = SCENARIOS[name]
    num_rollout, batch = 4, 32
    values = {k: v.format(workdir=workdir) if isinstance(v, str) else v for k, v in values.items()}
    cfg = tiny_job_config(workdir / "run", num_rollout=num_rollout, rollout_batch_size=batch, **values)
    job = start_job(cfg)
    inj = Injector(job, victim, after_first_rollout(role, state), sig=sig, times=times)
    inj.start()
    outcome = "completed"
    try:
        run(job)
    except (TrainerDied, SupervisionFailed) as e:  # the expected ways to stop; anything else propagates
        outcome = f"stopped: {type(e).__name__}"
    finally:
        inj.stop = True
        job.close()
    events = read_events(job.run_dir)
    deaths = [e for e in events if e["event"] in ("died", "hung") and e.get("role") == victim]
    readies = [e for e in events if e["event"] == "ready" and e.get("role") == victim]
    # a logged rollout must hold every sample exactly once; a completed run logs them all
    lost = samples_lost(job, num_rollout, outcome == "completed")
    first = inj.fired_at[0] if inj.fired_at else None
    detect = (deaths[0]["ts"] - first) if first and deaths else None
    recovered_ready = [e for e in readies if first and e["ts"] > first]
    # finished rollouts that a trainer recovery ran again (from the step after the checkpoint)
    redone = sum(e["from_step"] - e["to_step"] for e in events if e["event"] == "rewind")
    return {"fault": name, "injected": len(inj.fired_at), "outcome": outcome, "steps_redone": redone,
            "recovered": len(recovered_ready) if outcome == "completed" else 0, "samples_lost": lost,
            "detect_s": detect, "recover_s": (recovered_ready[0]["ts"] - first) if recovered_ready and first else None}


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--only", help="run only the scenarios whose name contains this ('chaos': the chaos rows, "
                    "'chaos-async', 'chaos-side': those with --train-async, disaggregated and side by side)")
    ap.add_argument("--chaos-rollouts", type=int, default=100, help="rollouts of the chaos run")
    ap.add_argument("--chaos-kills", type=int, default=2, help="kills of each engine and scorer in the chaos run")
    ap.add_argument("--seed", type=int, default=0, help="seed of the chaos run's kill order and moments")
    args = ap.parse_args(argv)
    rows = []
    for name in [*SCENARIOS, *CHAOS_ROWS]:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory(prefix="tdm-faults-") as d:
            if name.startswith("chaos"):
                row = run_chaos(Path(d), num_rollout=args.chaos_rollouts, batch=32, kills_each=args.chaos_kills,
                                seed=args.seed, values=CHAOS_ROWS[name])
                row = dict(row, injected=row["kills"], outcome=f"{row['outcome']}, {row['rollouts']} rollouts, "
                           f"learning bar {'reached' if row['learning_bar'] else 'NOT reached'} "
                           f"(reward {fmt(row['reward_first5'])} -> {fmt(row['reward_last5'])})")
                rows.append(row)
            else:
                rows.append(run_scenario(name, Path(d)))
        print(f"done: {name}", flush=True)
    print(f"\n{'fault':<42}{'injected':>9}{'recovered':>10}{'redone':>7}{'lost':>6}{'detect s':>10}{'recover s':>10}"
          "  outcome")
    for r in rows:
        print(f"{r['fault']:<42}{r['injected']:>9}{r['recovered']:>10}{r.get('steps_redone', 0):>7}"
              f"{r['samples_lost']:>6}{fmt(r['detect_s']):>10}{fmt(r['recover_s']):>10}  {r['outcome']}")
        if "kills_by_role" in r:
            print(f"{'':<42}kills by role {r['kills_by_role']}, by moment {r['kills_by_moment']}; "
                  f"slowest detection {fmt(r['detect_max_s'])} s, "
                  f"slowest recovery {fmt(r['recover_max_s'])} s (times: medians over the kills)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
