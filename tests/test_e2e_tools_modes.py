"""tiny_tools' multi-turn trajectories in the run's other modes, end to end on fake GPUs:
--train-async with dynamic sampling and the tool calls in the bwrap sandbox, and a resume from a
checkpoint that repeats the uninterrupted run bit for bit."""

import json
import shutil

import pytest

from bench.faults import ASYNC
from ppo.config.recipes import tiny_tools
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.loop import train
from ppo.state import checkpoint as ck
from roles.tools import sandbox

BWRAP, NO_SANDBOX = sandbox.choose_bwrap()
SMALL = dict(num_critic_only_steps=0, rollout_batch_size=4, global_batch_size=32, micro_batch_size=16,
             eval_prompt_data=None, eval_interval=None)


def is_timing(key: str) -> bool:
    return key.startswith("perf/") or key == "rollout/tool_time"  # wall clocks: the rest is bit for bit


def dumped(run_dir, step: int) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "samples" / f"rollout_{step:05d}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(BWRAP is None, reason=f"{NO_SANDBOX} (.ci/run says so)")
def test_async_dynamic_sampling_and_sandboxed_tools_train_on_tool_trajectories(tmp_path, tool_model):
    model, data = tool_model
    cfg = ensure_valid(override(
        tiny_tools(), run_dir=str(tmp_path / "run"), hf_checkpoint=model, prompt_data=data, num_rollout=3,
        tool_sandbox=True, over_sampling_batch_size=4, dynamic_sampling_max_extra_rounds=1,
        dynamic_sampling_filter_path="ppo.generate.dynamic_sampling:check_reward_nonzero_std", **SMALL, **ASYNC))
    history = train(cfg)
    assert [h["step"] for h in history] == [0, 1, 2]
    for k, h in enumerate(history):
        assert h["rollout/tool_calls"] > 0 and h["rollout/turns_per_sample"] > 1
        assert h["rollout/tool_errors"] < h["rollout/tool_calls"] / 2
        assert h["rollout/tool_time"] / h["rollout/tool_calls"] > 0.02  # a sandbox each (in process: microseconds)
        assert h["rollout/dynamic_sampling_kept_groups"] + h["rollout/dynamic_sampling_filled_groups"] >= 4
        rows = dumped(tmp_path / "run", k)
        assert len(rows) == 4 * 8 and {r["weight_version"] for r in rows} == {max(0, k - 1)}  # one version old
    # made and trained on by the same weights: the trainer reads the model's tokens where the engine wrote them
    assert history[0]["rollout/log_probs_diff"] < 1e-4
    assert "train/pg_loss" in history[-1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tool_run_resumed_from_its_checkpoint_repeats_the_uninterrupted_one(tmp_path, tool_model):
    model, data = tool_model
    cfg = ensure_valid(override(tiny_tools(), run_dir=str(tmp_path / "run"), hf_checkpoint=model, prompt_data=data,
                                num_rollout=3, save=str(tmp_path / "a"), save_interval=1, **SMALL))
    straight = train(cfg)
    # "the run stopped after rollout 0": its checkpoint, in a new folder (GRPO: no critic's)
    shutil.copytree(tmp_path / "a" / "rollout_00000", tmp_path / "b" / "rollout_00000")
    ck.write_tracker(str(tmp_path / "b"), "rollout_00000")
    resumed = train(override(cfg, load=str(tmp_path / "b"), save=str(tmp_path / "b")))
    assert [h["step"] for h in resumed] == [1, 2]
    for want, got in zip(straight[1:], resumed):
        # the engines take turns in lockstep (ppo.generate.engines): the same requests decode
        # together in both runs, so even the engine's log-probs (rollout/log_probs_diff) repeat
        differ = {k: (want[k], got.get(k)) for k in want
                  if not is_timing(k) and not k.endswith("_total") and want[k] != got.get(k)}
        assert differ == {}, f"step {want['step']}: {differ}"
        assert want["rollout/tool_calls"] > 0
