"""A small live job to watch: ``python -m runtime.demo [--run-dir DIR] [--seconds N]``.

Two engines, on fake GPUs 0 and 1, and a trainer spanning both take each GPU's lease
in turn, as a colocated PPO iteration does (docs/design.md, "The memory
handoff"): the engines load weights and KV cache, generate and offload; the trainer
onloads, trains, and offloads all but its weights, which it keeps for the weight sync.
A CPU scorer turns samples into rewards, and the driver publishes one ``metrics`` event
per step. The scorer crashes once, on its second call; the supervisor restarts it
(one_for_one) and the driver scores again on the new incarnation.

Nothing is trained and the numbers are made up; the processes, calls, leases, the
fake-GPU memory ledger and the events are real. Watch it from another terminal with
``python -m runtime.monitor RUN_DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import numpy as np

from runtime import Actor, ActorDied, ActorHandle, Supervisor, endpoint, gather
from runtime.fakegpu import visible_fake_devices

GIB = 1 << 30
GPUS = [0, 1]
FAKE_GPU_BYTES = 80 * GIB
ENGINE_BYTES = {"weights": 8 * GIB, "kv_cache": 40 * GIB}     # on its one GPU
TRAINER_BYTES = {"weights": 4 * GIB, "optimizer": 24 * GIB}  # on each of its GPUs (sharded)
COMPUTE_S = 0.25  # fake work per generate/train, slow enough to see the states change
SAMPLES_PER_ENGINE = 64
SCORER_CRASH_CALL = 2


class SimulatedCrash(BaseException):
    """A fatal error. A BaseException is not returned to the caller as a RemoteError:
    it ends the role process, with its traceback in the role's error file."""


class _DeviceMemory:
    """The bytes this role keeps under each tag on every GPU it sees (fake GPUs here)."""

    def __init__(self, holder: str):
        self.holder = holder
        self.devices = visible_fake_devices()
        self.by_tag: dict[str, int] = {}

    def set(self, tag: str, nbytes: int) -> None:
        for device in self.devices:
            device.set_usage(holder=self.holder, tag=tag, nbytes=nbytes)
        self.by_tag[tag] = nbytes

    @property
    def per_gpu(self) -> int:
        return sum(self.by_tag.values())


class Engine(Actor):
    """A rollout engine: holds weights and KV cache on its GPU only while it generates."""

    lifecycle = {"starting": frozenset({"ready"}), "ready": frozenset({"generating", "offloaded"}),
                 "generating": frozenset({"ready"}), "offloaded": frozenset({"ready"})}

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.memory = _DeviceMemory(self.context.name)

    @endpoint
    def onload(self) -> None:
        for tag, nbytes in ENGINE_BYTES.items():
            self.memory.set(tag, nbytes)
        self.set_state("ready")

    @endpoint
    def generate(self, step: int, num_samples: int) -> np.ndarray:
        self.set_state("generating")
        time.sleep(COMPUTE_S)
        quality = 1.0 - math.exp(-step / 20)  # the "policy" improves with training
        samples = self.rng.normal(quality, 0.3, size=num_samples).astype(np.float32)  # [num_samples]
        self.set_state("ready")
        return samples

    @endpoint
    def offload(self) -> int:
        """Free the KV cache and weights; returns the bytes left on the GPU."""
        for tag in ENGINE_BYTES:
            self.memory.set(tag, 0)
        self.set_state("offloaded")
        return self.memory.per_gpu


class Trainer(Actor):
    """The actor trainer: optimizer state on the GPUs only while it trains."""

    lifecycle = {"starting": frozenset({"ready"}), "ready": frozenset({"training", "offloaded"}),
                 "training": frozenset({"ready"}), "offloaded": frozenset({"ready"})}

    def __init__(self):
        self.memory = _DeviceMemory(self.context.name)
        self.num_updates = 0

    @endpoint
    def onload(self) -> None:
        for tag, nbytes in TRAINER_BYTES.items():
            self.memory.set(tag, nbytes)
        self.set_state("ready")

    @endpoint
    def train(self, rewards: np.ndarray) -> dict:
        self.set_state("training")
        time.sleep(COMPUTE_S)
        self.num_updates += 1
        advantages = rewards - rewards.mean()
        stats = {"loss": float(-np.mean(advantages * 0.1) + 1.0 / (1 + self.num_updates)),
                 "grad_norm": float(np.std(advantages) + 0.05)}
        self.set_state("ready")
        return stats

    @endpoint
    def offload(self) -> int:
        """Free the optimizer state, keep the weights for the sync; returns bytes left per GPU."""
        self.memory.set("optimizer", 0)
        self.set_state("offloaded")
        return self.memory.per_gpu


class Scorer(Actor):
    """A CPU reward scorer that crashes once, in its first incarnation."""

    def __init__(self):
        self.num_calls = 0

    @endpoint
    def score(self, samples: np.ndarray) -> np.ndarray:
        self.num_calls += 1
        if self.context.incarnation == 0 and self.num_calls == SCORER_CRASH_CALL:
            raise SimulatedCrash(f"{self.context.name}: simulated fatal error on call {self.num_calls}")
        return (samples > 0.5).astype(np.float32)  # [num_samples], 1 = correct


def score_with_retry(sup: Supervisor, scorer: ActorHandle, samples: np.ndarray) -> np.ndarray:
    try:
        return scorer.score(samples)
    except ActorDied as died:
        # The scorer is stateless and restarted one_for_one: score again on the new incarnation.
        print(f"  {died.role} died ({died.reason}); scoring again once it is restarted", flush=True)
        sup.wait_ready([died.role], timeout=120)
        return scorer.score(samples)


def one_step(sup: Supervisor, engines: list[ActorHandle], trainer: ActorHandle, scorer: ActorHandle,
             step: int) -> None:
    start = time.perf_counter()
    for gpu, engine in zip(GPUS, engines):
        sup.leases.acquire(gpu, engine.name)
    gather([e.onload.call() for e in engines])
    samples = np.concatenate(gather([e.generate.call(step, SAMPLES_PER_ENGINE) for e in engines]))
    for gpu, engine, bytes_left in zip(GPUS, engines, gather([e.offload.call() for e in engines])):
        sup.leases.release(gpu, engine.name, bytes_left)
    rewards = score_with_retry(sup, scorer, samples)

    sup.leases.acquire_all(GPUS, trainer.name)
    trainer.onload()
    stats = trainer.train(rewards)
    bytes_left = trainer.offload()
    sup.leases.release_all(GPUS, trainer.name, {gpu: bytes_left for gpu in GPUS},
                           may_keep=TRAINER_BYTES["weights"])
    sup.publish("metrics", step=step, metrics={
        "rollout/raw_reward": float(rewards.mean()), "train/loss": stats["loss"],
        "train/grad_norm": stats["grad_norm"], "perf/step_time_s": time.perf_counter() - start})


def run_demo(run_dir: Path, seconds: float) -> int:
    """Run the job for ``seconds`` after its actors are ready; returns the number of steps."""
    with Supervisor(run_dir, fake_gpus=len(GPUS), fake_gpu_bytes=FAKE_GPU_BYTES) as sup:
        print(f"run dir: {sup.run_dir}\nwatch it: python -m runtime.monitor {sup.run_dir}", flush=True)
        engines = [sup.spawn(f"engine{gpu}", Engine, seed=gpu, gpus=[gpu]) for gpu in GPUS]
        trainer = sup.spawn("trainer", Trainer, gpus=GPUS)
        scorer = sup.spawn("scorer", Scorer)
        sup.wait_ready(timeout=120)
        until = time.monotonic() + seconds
        step = 0
        while time.monotonic() < until:
            step += 1
            one_step(sup, engines, trainer, scorer, step)
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path,
                        default=Path("runs") / f"demo-{datetime.datetime.now():%Y%m%d-%H%M%S}",
                        help="where the events, error files and fake GPUs go (default: runs/demo-TIMESTAMP)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to run once started (default: 60)")
    args = parser.parse_args(argv)
    if not args.seconds > 0:
        parser.error(f"--seconds {args.seconds}: must be > 0")
    start = time.monotonic()
    try:
        steps = run_demo(args.run_dir, args.seconds)
    except KeyboardInterrupt:
        print("interrupted: every role was stopped", flush=True)
        return 130
    print(f"done: {steps} steps in {time.monotonic() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    # Run the importable module, not __main__, so role processes unpickle runtime.demo.X.
    from runtime.demo import main as _main

    sys.exit(_main())
