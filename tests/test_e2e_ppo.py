"""End-to-end PPO through the real runtime: tiny_ppo on 2 fake GPUs, colocated."""

import json

import pytest

from ppo.config import PPOConfig
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.setup.job import start_job
from ppo.gpu.plan_check import plan_mismatches
from ppo.gpu.handoffs import check_weights_equal
from ppo.loop import run, train
from ppo.config.recipes import tiny_ppo
from roles.weight_checksum import checksum_named_tensors
from runtime.fakegpu import FakeDevice, check_no_overlap


def tiny(tmp_path, **values) -> PPOConfig:
    return ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), **values))


@pytest.mark.timeout(300)
def test_colocated_iterations_never_overlap_and_weights_match_after_every_sync(tmp_path):
    cfg = tiny(tmp_path, num_rollout=3, num_critic_only_steps=1, check_weight_update_equal=True,
               rollout_batch_size=16, save=str(tmp_path / "ckpt"), save_interval=2)
    history = train(cfg)  # check_weight_update_equal raises if an engine differs after a sync
    assert [h["rollout/weight_version"] for h in history] == [0, 1, 2]
    assert "train/pg_loss" not in history[0] and "train/pg_loss" in history[1]  # warm-up step
    assert all(h["rollout/log_probs_diff"] < 1e-4 for h in history)  # engines run the actor's policy
    assert_colocated_ledgers(tmp_path / "run")
    # the memory plan: each phase's peak on each fake GPU, steady (step 2: the optimizers exist)
    # exactly or below by what narrower micro-batches left out (ppo.gpu.plan_check)
    assert plan_mismatches(tmp_path / "run", 2, below=0.15) == []
    from runtime.events import read_events
    moves = [(e["role"], e["new"]) for e in read_events(tmp_path / "run") if e["event"] == "state"]
    # trainers are rank groups (one process per GPU); each rank publishes its lifecycle
    for move in [("actor.0", "onloaded"), ("actor.1", "training"), ("critic.0", "training"),
                 ("critic.1", "training"), ("actor.1", "offloaded"), ("rollout-0", "released"),
                 ("rollout-1", "ready")]:
        assert move in moves  # lifecycles are published as events
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in lines if "eval/weight_version" not in r]  # tiny_ppo evaluates before step 0
    assert len(rollouts) == 3 and "rollout/raw_reward" in rollouts[0]
    assert [r["step"] for r in lines if "eval/weight_version" in r] == [0]
    sample = json.loads((tmp_path / "run" / "samples" / "rollout_00002.jsonl").read_text().splitlines()[0])
    assert sample["weight_version"] == 1 and {"prompt", "response", "reward", "label"} <= set(sample)
    # --save-interval 2: the actor and the critic save into separate folders
    for folder in ("ckpt", "ckpt_critic"):
        saved = tmp_path / folder / "rollout_00001"
        assert (saved / "model.safetensors").exists() and (saved / "optimizer.pt").exists()


@pytest.mark.timeout(300)
def test_critic_only_warmup_leaves_the_actor_untouched(tmp_path):
    import torch
    from ppo.tiny_model import load_causal_lm

    # validation rejects a run that never trains the actor; the driver must still honour it
    cfg = override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=2, num_critic_only_steps=2,
                   rollout_batch_size=16)
    job = start_job(cfg)
    try:
        history = run(job)
        initial = checksum_named_tensors(load_causal_lm(job.hf_checkpoint, torch.float32).named_parameters())
        assert job.actor.weights_checksum() == initial
        assert all(e.weights_checksum() == initial for e in job.engines)
        assert [h["rollout/weight_version"] for h in history] == [0, 0]
        assert all("train/critic-value_loss" in h and "train/pg_loss" not in h for h in history)
    finally:
        job.close()


def test_weight_check_names_the_engine_and_tensors():
    class Ref:
        def __init__(self, value):
            self.value = value

        def result(self, timeout=None):
            return self.value

    class Handle:
        def __init__(self, name, sums):
            self.name, self._sums = name, sums
            self.weights_checksum = self

        def __call__(self):
            return self._sums

        def call(self):
            return Ref(self._sums)

    class FakeJob:
        actor = Handle("actor", {"a": "1", "b": "2"})
        engines = [Handle("rollout-0", {"a": "1", "b": "2"}), Handle("rollout-1", {"a": "1", "b": "X"})]

    with pytest.raises(RuntimeError, match="rollout-1 differs from the actor on 1 tensors.*'b'"):
        check_weights_equal(FakeJob())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_ppo_learns(tmp_path):
    """A shorter, seeded version of the README bar: reward rises from chance level. It is also
    the colocated case of tests/test_placement_modes.py: synced after every step past the
    warm-up, the engines' weights checked after each sync, and the ledgers exact."""
    history = train(tiny(tmp_path, num_rollout=40, check_weight_update_equal=True, eval_prompt_data=None,
                         eval_interval=None))
    assert [h["rollout/weight_version"] for h in history] == [max(0, s) for s in range(40)]  # one warm-up step
    assert_learns(history)
    assert_colocated_ledgers(tmp_path / "run")


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_tiny_ppo_learns_with_megatron_on_one_cuda_gpu(tmp_path):
    """The same bar on one real GPU (`bash .ci/gpu -k learns`): megatron trainers and the
    built-in engine colocated and synchronous, bf16. Beside the side-by-side run of
    tests/test_side_by_side.py (async, MPS) it tells the backend's learning from that mode's."""
    pytest.importorskip("megatron.core")
    history = train(tiny(tmp_path, num_rollout=40, train_backend="megatron", fake_gpus=False, num_gpus_per_node=1,
                         actor_num_gpus_per_node=1, check_weight_update_equal=True, eval_prompt_data=None,
                         eval_interval=None))
    assert [h["train/skipped_updates_total"] for h in history] == [0] * 40
    assert_learns(history)


def assert_colocated_ledgers(run_dir) -> None:
    """Each fake GPU's ledger: no two holders ever overlapped, and actor, critic and the GPU's
    engine each grew there (the handoff really happened)."""
    for gpu in (0, 1):
        hist = FakeDevice(run_dir / "fakegpu", gpu).history()
        assert check_no_overlap(hist) == []
        growers = {h["holder"] for h in hist if h.get("kind") == "usage" and h["nbytes"]}
        assert {"actor", "critic", f"rollout-{gpu}"} <= growers


def assert_learns(history: list[dict]) -> None:
    """The bar of a 40-rollout tiny_ppo run: from chance level, up by 0.25."""
    rewards = [h["rollout/raw_reward"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.25, f"the warm-started model should answer at about chance level, got {first:.2f}"
    assert last - first >= 0.25, f"reward did not rise: first 5 {first:.2f}, last 5 {last:.2f}"
