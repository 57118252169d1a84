"""--train-async end to end on fake GPUs, engines and trainers on GPUs of their own: the next
rollout generates before this step's weights change, every sample is one version old (none
older), decoupled PPO weights the loss, an engine killed mid-rollout loses no sample (scorers
and more kills: tests/test_faults_ppo.py's chaos test), and tiny_ppo learns."""

import json

import pytest

from bench.faults import ASYNC, after_first_rollout
from bench.iteration import analyse
from ppo.config import num_critic_only_steps
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.state.checkpoint import rollout_dir_name, write_tracker
from ppo.loop import train
from ppo.config.recipes import tiny_ppo
from runtime.events import read_events
from runtime.fakegpu import FakeDevice, check_no_overlap
from tests.test_e2e_ppo import assert_learns
from tests.test_faults_ppo import assert_full_batches, run_with_fault

pytestmark = pytest.mark.timeout(300)



def tiny(tmp_path, **values):
    return ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), **{**ASYNC, **values}))


def dumped(tmp_path, step: int) -> list[dict]:
    path = tmp_path / "run" / "samples" / f"rollout_{step:05d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_next_rollout_generates_before_the_weights_change_and_samples_are_one_version_old(tmp_path):
    """On 4 fake GPUs (any split works): trainers as two data-parallel ranks on GPUs 0-1, two
    engines on GPUs 2-3."""
    num_rollout = 6
    cfg = tiny(tmp_path, num_rollout=num_rollout, rollout_batch_size=32, eval_interval=None, eval_prompt_data=None,
               num_gpus_per_node=4, actor_num_gpus_per_node=2, rollout_num_gpus=2, check_weight_update_equal=True)
    history = train(cfg)
    warmup = num_critic_only_steps(cfg)
    assert warmup == 1
    for k, h in enumerate(history):
        trainer = max(0, k - warmup)  # the actor's version while step k trains
        made_on = max(0, k - 1 - warmup)  # the engines' version while step k - 1 trained
        assert {s["weight_version"] for s in dumped(tmp_path, k)} == {made_on}, k
        assert h["rollout/staleness"] == trainer - made_on <= 1 and h["rollout/stale_groups"] == 0
        assert h["rollout/weight_version"] == max(0, k + 1 - warmup)  # synced after every update
    # decoupled PPO: TIS weights of the trainer's log-probs before the update over the engine's
    # one version back; they differ from 1 once the samples are a version old
    assert all(h["train/tis"] == pytest.approx(1.0, abs=1e-4) for h in history[:warmup + 1])
    assert all(h["train/tis_abs"] > 1e-3 for h in history[warmup + 1:])

    events = read_events(tmp_path / "run")
    generating = [e["ts"] for e in events
                  if e["event"] == "state" and e["role"] == "rollout-0" and e["new"] == "generating"]
    syncs = {e["step"]: e["ts"] for e in events
             if e["event"] == "phase" and e.get("phase") == "weight_sync" and e["action"] == "begin"}
    assert len(generating) == num_rollout and sorted(syncs) == list(range(warmup, num_rollout))
    for k, sync_ts in syncs.items():
        if k + 1 < num_rollout:  # rollout k + 1 was under way while step k trained
            assert generating[k + 1] < sync_ts, k
    rollout_starts = {e["step"]: e["ts"] for e in events
                      if e["event"] == "phase" and e.get("phase") == "log_probs" and e["action"] == "begin"}
    assert all(generating[k + 1] < rollout_starts[k + 1] for k in range(num_rollout - 1))

    # bench.iteration's table in async mode: each step but the last has its engines generate the
    # next rollout inside it, and a rollout's tokens/s is over the time it generated ahead
    steps = analyse(tmp_path / "run", [(0.0, 0, 0)], {"d2h": 1.0, "h2d": 1.0}, num_samples=128, prompts={})
    for s in steps[:-1]:
        assert s["generating_role_s"]["rollout-0"] > 0 and s["generating_role_s"]["rollout-1"] > 0
    for s in steps[1:]:
        assert s["rollout_ahead_s"] > 0
        assert s["rollout_tokens_per_s"] == pytest.approx(s["response_tokens"] / s["rollout_ahead_s"])

    devices = {g: FakeDevice(tmp_path / "run" / "fakegpu", g).history() for g in range(4)}
    assert all(check_no_overlap(hist) == [] for hist in devices.values())
    holders = {g: {h["holder"] for h in hist if h["kind"] == "usage" and h["nbytes"]} for g, hist in devices.items()}
    assert holders[0] == holders[1] == {"actor", "critic"}
    assert holders[2] == {"rollout-0"} and holders[3] == {"rollout-1"}


def test_async_engine_killed_while_generating_ahead_is_resynced_and_loses_no_sample(tmp_path):
    values = dict(num_rollout=4, rollout_batch_size=32, check_weight_update_equal=True, **ASYNC)
    # after rollout 0 is logged, the engine's next generate is the rollout ahead, beside training
    history, _ = run_with_fault(tmp_path, "rollout-0", after_first_rollout("rollout-0", "generating"), **values)
    assert sum(h["rollout/engine_restarts"] for h in history) == 1
    assert_full_batches(tmp_path, values, 4)
    assert all(h["rollout/staleness"] <= 1 for h in history)


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
def test_a_checkpoint_taken_with_a_rollout_ahead_resumes_with_that_rollouts_prompts(tmp_path):
    """The rollout ahead drew its prompts before the save: the checkpoint records the position
    before them, so the resumed run draws the same prompts (on its own weights)."""
    ckpt = tmp_path / "ckpt"
    values = dict(num_rollout=4, rollout_batch_size=16, eval_interval=None, eval_prompt_data=None,
                  num_critic_only_steps=0, save=str(ckpt), save_interval=2)
    train(tiny(tmp_path / "a", **values))  # saves after rollouts 1 (rollout 2 ahead) and 3
    write_tracker(str(ckpt), rollout_dir_name(1))
    write_tracker(str(ckpt) + "_critic", rollout_dir_name(1))
    # its own --save: the checkpoints under --load are run a's, which b's saves must not replace
    history = train(tiny(tmp_path / "b", **{**values, "save": str(tmp_path / "ckpt-b")}, load=str(ckpt)))
    assert [h["step"] for h in history] == [2, 3]
    for step in (2, 3):
        assert [s["prompt"] for s in dumped(tmp_path / "b", step)] == [s["prompt"] for s in dumped(tmp_path / "a", step)]
    # generated again on the restored weights (version 2), not the version 1 of the first run
    assert {s["weight_version"] for s in dumped(tmp_path / "b", 2)} == {2}
    assert {s["weight_version"] for s in dumped(tmp_path / "a", 2)} == {1}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_ppo_learns_in_async_mode(tmp_path):
    """tests/test_e2e_ppo.py's bar for tiny_ppo, one step off-policy."""
    assert_learns(train(tiny(tmp_path, num_rollout=40)))


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_tiny_ppo_learns_in_async_mode_on_two_gpus(tmp_path):
    """On real GPUs (`bash .ci/gpu -k async` on a 2-GPU machine): megatron trainers on GPU 0, the
    built-in engine on GPU 1; the engine's weights are checked against the actor's after each sync."""
    import torch

    pytest.importorskip("megatron.core")
    if torch.cuda.device_count() < 2:
        pytest.skip("--train-async puts the engine on a GPU of its own: needs 2 GPUs")
    history = train(tiny(tmp_path, num_rollout=40, train_backend="megatron", fake_gpus=False, num_gpus_per_node=2,
                         check_weight_update_equal=True))
    assert all(h["rollout/staleness"] <= 1 for h in history)
    assert_learns(history)

