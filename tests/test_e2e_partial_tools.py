"""tiny_tools with --partial-rollout end to end (docs/partial_rollouts.md, "Tool trajectories"):
rollouts that train continued trajectories, a resume from a checkpoint (the buffer with its cut
trajectories) that repeats the uninterrupted run, and the rollout ahead of --train-async."""

import json
import shutil

import pytest

from bench.faults import ASYNC
from ppo.config.recipes import tiny_tools
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.generate.partial_buffer import BUFFER_KEY
from ppo.loop import train
from ppo.state import checkpoint as ck
from tests.test_e2e_tools_modes import SMALL, is_timing

# 32 groups of 2 started, 16 trained: 32 samples, SMALL's global batch
PARTIAL = dict(partial_rollout=True, n_samples_per_prompt=2, rollout_batch_size=16, over_sampling_batch_size=32,
               num_rollout=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_partial_tool_rollouts_continue_cut_trajectories_and_a_resume_repeats_the_run(tmp_path, tool_model):
    model, data = tool_model
    cfg = ensure_valid(override(tiny_tools(), run_dir=str(tmp_path / "run"), hf_checkpoint=model, prompt_data=data,
                                save=str(tmp_path / "a"), save_interval=1, **{**SMALL, **PARTIAL}))
    straight = train(cfg)
    for h in straight:
        assert h["rollout/partial_buffered_groups"] == 16 and h["rollout/tool_calls"] > 0  # 32 started, 16 trained
        assert "train/tis" in h  # carried tokens are corrected (no mask flag)
    # tiny_tools has no tail (every trajectory: a call, then a short answer), so rollout 0 cuts
    # nothing and buffers 16 complete groups; rollout 1 trains those, and its cut (clock 0) leaves
    # every new trajectory after its first model turn (those that end there: finished), its call
    # to run again in rollout 2
    partial = [{k: v for k, v in h.items() if "partial" in k} for h in straight]
    assert straight[0]["rollout/partial_aborted_requests"] == 0 and straight[1]["rollout/partial_aborted_requests"] > 16, partial
    assert straight[2]["rollout/partial_resumed_samples"] == 32 and straight[2]["rollout/partial_carried_tokens"] > 0
    buffered = json.loads((tmp_path / "a" / "rollout_00001" / ck.DRIVER_STATE_FILE).read_text())["data"][BUFFER_KEY]
    assert all(len(s["trajectory"]["turns"]) == 1 for g in buffered for s in g)  # cut after a model turn
    assert sum(s["finish_reason"] is None for g in buffered for s in g) == straight[1]["rollout/partial_aborted_requests"]

    # "the run stopped after rollout 1": its checkpoint (with the cut trajectories), in a new folder
    shutil.copytree(tmp_path / "a" / "rollout_00001", tmp_path / "b" / "rollout_00001")  # GRPO: no critic's
    ck.write_tracker(str(tmp_path / "b"), "rollout_00001")
    resumed = train(override(cfg, load=str(tmp_path / "b"), save=str(tmp_path / "b")))
    assert [h["step"] for h in resumed] == [2]
    for want, got in zip(straight[2:], resumed):  # bit for bit: turns go to the engines in lockstep on the CPU
        differ = {k: (want[k], got.get(k)) for k in want
                  if not is_timing(k) and not k.endswith("_total") and want[k] != got.get(k)}
        assert differ == {}, f"step {want['step']}: {differ}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_partial_tool_rollouts_generate_ahead_with_train_async(tmp_path, tool_model):
    """--train-async (engines and trainer on GPUs of their own): the rollout ahead is a partial one
    of tool trajectories; a group more than --max-weight-staleness versions old is made again whole."""
    model, data = tool_model
    history = train(ensure_valid(override(tiny_tools(), run_dir=str(tmp_path / "run"), hf_checkpoint=model,
                                          prompt_data=data, **{**SMALL, **PARTIAL, **ASYNC})))
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["rollout/partial_buffered_groups"] == 16 and h["rollout/staleness"] <= 1
        assert 0 <= h["rollout/partial_offpolicy_token_share"] <= 1 and "train/tis" in h
    assert history[2]["rollout/partial_resumed_samples"] > 0
