"""tiny_ppo with --partial-rollout end to end (docs/partial_rollouts.md): the step's metrics,
TIS on the carried tokens, a checkpoint that stores the buffer, and a resumed run that continues
from exactly that buffer; eval is never partial."""

import json
import shutil

import pytest

from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.config.recipes import tiny_ppo
from ppo.generate.partial_buffer import BUFFER_KEY
from bench.faults import ASYNC
from ppo.loop import train
from ppo.state import checkpoint as ck

# whole runs (2-3 job starts each): past the default suite's per-test budget, so `make test-slow`
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400), pytest.mark.usefixtures("one_torch_thread")]


def test_partial_rollouts_train_checkpoint_their_buffer_and_a_resume_continues_it(tmp_path):
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=2, rollout_batch_size=16,
                                over_sampling_batch_size=24, partial_rollout=True, num_critic_only_steps=0,
                                save=str(tmp_path / "ckpt"), save_interval=1, eval_interval=2))
    history = train(cfg)
    for h in history:
        assert h["rollout/partial_buffered_groups"] == 8  # 24 started, 16 trained: the rest wait
        assert {"rollout/partial_carried_tokens", "rollout/partial_max_age", "rollout/partial_aborted_requests",
                "rollout/partial_offpolicy_token_share", "train/tis"} <= set(h)  # TIS without the mask flag
    assert history[1]["rollout/partial_resumed_groups"] >= 1
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "eval/weight_version" in x]
    assert evals and not any(k.startswith("rollout/partial") for e in evals for k in e)  # eval is never partial

    state = json.loads((tmp_path / "ckpt" / "rollout_00000" / ck.DRIVER_STATE_FILE).read_text())
    buffered = state["data"][BUFFER_KEY]
    assert len(buffered) == 8 and all(len(g) == 8 for g in buffered)
    for s in (s for g in buffered for s in g):
        assert len(s["response_ids"]) == len(s["rollout_log_probs"]) == len(s["weight_versions"])
        assert s["start_step"] == 0 and set(s["weight_versions"]) <= {0}

    # resume after rollout 0: rollout 1 trains the checkpoint's complete buffered groups, in buffer
    # order (the buffered groups come first; those that complete in rollout 1 join them in that order)
    for folder in ("ckpt", "ckpt_critic"):
        ck.write_tracker(str(tmp_path / folder), "rollout_00000")
    resumed = train(override(cfg, load=str(tmp_path / "ckpt"), save=None))
    assert [h["step"] for h in resumed] == [1]
    done = [g for g in buffered if all(s["finish_reason"] is not None for s in g)]
    batch = [json.loads(x) for x in (tmp_path / "run" / "samples" / "rollout_00001.jsonl").read_text().splitlines()]
    trained = iter(s["prompt"] for s in batch[::8])
    assert all(g[0]["prompt"]["prompt"] in trained for g in done)  # a subsequence: in order
    assert resumed[0]["rollout/partial_resumed_samples"] >= 8 * len(done)


def test_partial_rollouts_generate_ahead_with_train_async(tmp_path):
    """--train-async on 4 fake GPUs (tests/test_async_ppo.py's layout): the rollout ahead is a
    partial one; a group generated more than --max-weight-staleness versions back is made again
    whole (it has no per-token versions then, ppo.generate.batch fills them in)."""
    layout = dict(num_gpus_per_node=4, actor_num_gpus_per_node=2, rollout_num_gpus=2)
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), **{**ASYNC, **layout}, num_rollout=3,
                                rollout_batch_size=16, over_sampling_batch_size=24, partial_rollout=True,
                                eval_interval=None, eval_prompt_data=None))
    history = train(cfg)
    assert [h["step"] for h in history] == [0, 1, 2]
    for h in history:
        assert h["rollout/partial_buffered_groups"] == 8 and h["rollout/staleness"] <= 1
        assert 0 <= h["rollout/partial_offpolicy_token_share"] <= 1 and "train/tis" in h


def test_a_partial_run_resumed_from_its_checkpoint_repeats_the_uninterrupted_one(tmp_path):
    """3 rollouts straight vs rollout 0, its checkpoint (the buffer with its unfinished samples),
    and rollouts 1-2 in a new job: every metric but timings bit for bit. The engines abort in
    lockstep (roles/rollout/abort_board.py), so each abort lands on the same tokens in both runs."""
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=3, rollout_batch_size=16,
                                over_sampling_batch_size=24, partial_rollout=True, save=str(tmp_path / "a"),
                                save_interval=1, eval_interval=None, eval_prompt_data=None))
    straight = train(cfg)
    for folder in ("a", "a_critic"):  # "the run stopped after rollout 0": its checkpoint, in a new folder
        shutil.copytree(tmp_path / folder / "rollout_00000", tmp_path / folder.replace("a", "b") / "rollout_00000")
        ck.write_tracker(str(tmp_path / folder.replace("a", "b")), "rollout_00000")
    buffered = json.loads((tmp_path / "b" / "rollout_00000" / ck.DRIVER_STATE_FILE).read_text())["data"][BUFFER_KEY]
    assert any(s["response_ids"] and s["finish_reason"] is None for g in buffered for s in g)  # cut mid-way
    resumed = train(override(cfg, load=str(tmp_path / "b"), save=str(tmp_path / "b")))
    assert [h["step"] for h in resumed] == [1, 2]
    for want, got in zip(straight[1:], resumed):
        differ = {k: (want[k], got.get(k)) for k in set(want) | set(got)
                  if not k.startswith("perf/") and not k.endswith("_total") and want.get(k) != got.get(k)}
        assert differ == {}, f"step {want['step']}: {differ}"
        assert want["rollout/partial_resumed_samples"] > 0 and want["rollout/partial_aborted_requests"] > 0
