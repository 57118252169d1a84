"""Partial rollouts (ppo/generate/partial.py, docs/partial_rollouts.md): the abort board, the
built-in engine's abort mid-call, and the driver's over-sampling rollout that stops at enough
complete groups, buffers the rest with their tokens, log-probs and weight versions, and
continues them first in the next rollout, into the very samples an uninterrupted engine gives."""

import json
import threading
import time

import pytest

from ppo.config import override, validate
from ppo.config.recipes import tiny_ppo
from ppo.generate.dynamic_sampling import DynamicSampling
from ppo.generate.partial import partial_rollout
from ppo.generate.partial_buffer import BUFFER_KEY, PartialSource
from ppo.generate.rollout import FORCED_LENGTHS_KEY, SamplingParams
from ppo.prompts.dataset import PromptDataset
from ppo.tiny_model import EOS_ID, build_tiny_checkpoint
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.abort_board import AbortBoard
from runtime import Supervisor

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

LONG = 64  # tokens of a straggler: long enough that an abort always finds it running


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """The tiny model with room for LONG-token responses."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_long")), seed=0, max_position_embeddings=256)


def supervisor(run_dir) -> Supervisor:
    # a loaded 2-core machine can starve a starting engine's heartbeat for seconds
    return Supervisor(run_dir, heartbeat_interval=0.2, heartbeat_timeout=15.0, shutdown_grace_s=2.0)


def spawn_engines(sup: Supervisor, ckpt: str) -> list:
    engines = [sup.spawn(f"rollout-{i}", RolloutEngine,
                         EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=16, engine_index=i), env={"OMP_NUM_THREADS": "1"})  # as ppo.setup.job starts them: threads only fight here
               for i in range(2)]
    sup.wait_ready(timeout=90)
    return engines


def recovery(sup: Supervisor):
    """The driver's engine recovery without the job: wait for the restarted engine (or raise)."""
    return lambda role, dead: sup.wait_restarted(role.name, dead, timeout=60)


@pytest.fixture(scope="module")
def engine_sup(long_ckpt, tmp_path_factory):
    sup = supervisor(tmp_path_factory.mktemp("run"))
    try:
        yield sup, spawn_engines(sup, long_ckpt)
    finally:
        sup.shutdown()


@pytest.fixture
def engines(engine_sup):
    return engine_sup[1]


def requests(lengths: list[int]) -> list[dict]:
    return [{"id": i, "prompt_ids": [5 + i % 7, 14, 6], "sampling": {"max_new_tokens": n, "ignore_eos": True,
                                                                     "seed": 100 + i}}
            for i, n in enumerate(lengths)]


def test_the_board_carries_finishes_and_the_drivers_abort_from_one_mapping_to_another():
    board = AbortBoard.create(groups=[0, 0, 1], chunks=[0, 0, 0], need=1, lockstep=False)
    engine_view = AbortBoard.open(board.path, [0, 1, 2])
    engine_view.finish(2)
    assert board.finished().tolist() == [False, False, True] and not engine_view.aborted()
    board.check()  # group 1 is complete: the driver aborts
    assert engine_view.aborted()
    with pytest.raises(ValueError, match=r"request id=3 is outside the board's \[0, 3\)"):
        engine_view.finish(3)
    engine_view.close()
    board.close()
    with pytest.raises(ValueError, match="is not a board file"):
        AbortBoard.open(board.path, [0])  # the driver's close removed it


def test_in_lockstep_the_calls_abort_after_the_same_sync_however_fast_each_runs():
    """Two calls (chunks 0 and 1), each group split over both. Group 0 is complete by sync 4 (its
    requests finish at syncs 2 and 4), group 1 only at sync 5: with need=1 both calls end at their
    5th sync, whatever their speeds, and nothing finished after sync 4 counts."""
    finishes = {0: {2: 0, 5: 2}, 1: {4: 1, 3: 3}}  # chunk -> {sync: request id}
    for delays in ((0.0, 0.003), (0.003, 0.0)):
        board = AbortBoard.create(groups=[0, 0, 1, 1], chunks=[0, 1, 0, 1], need=1, lockstep=True)
        ended = {}

        def call(chunk: int, delay: float) -> None:
            view = AbortBoard.open(board.path, [chunk, chunk + 2])
            sync = 0
            while not view.aborted():
                sync += 1
                time.sleep(delay)
                if sync in finishes[chunk]:
                    view.finish(finishes[chunk][sync])
            ended[chunk] = sync + 1  # the sync it read the abort at
            view.close()

        threads = [threading.Thread(target=call, args=(k, d)) for k, d in enumerate(delays)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert ended == {0: 5, 1: 5} and board.abort_sync == 4
        assert board.finished().tolist() == [True, True, False, True] and board.complete_groups() == 1
        board.close()


def test_the_buffer_serves_its_groups_before_new_prompts_and_the_data_position_carries_it(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    source = PartialSource(PromptDataset(path, seed=3))
    first = source.next_groups(3, 2, step=0)
    first[0][0].update(response_ids=[7], rollout_log_probs=[-0.1234567890123], weight_versions=[0])
    source.put_back(first[:2])
    saved = json.loads(json.dumps(source.state_dict()))  # as driver_state.json holds it
    again = source.next_groups(3, 2, step=1)
    assert again[:2] == first[:2] and again[2][0]["start_step"] == 1  # buffered first, then the dataset
    restored = PartialSource(PromptDataset(path, seed=3))
    restored.load_state_dict(saved)
    assert restored.next_groups(3, 2, step=1) == again  # the same groups, floats exact, the same next prompt
    assert PartialSource(PromptDataset(path, seed=3)).num_skipped == 0  # the dataset's other fields


def test_an_engine_aborted_mid_call_returns_the_finished_whole_and_the_rest_so_far(long_ckpt):
    engine = RolloutEngine(EngineConfig(hf_checkpoint=long_ckpt, dtype="float32", max_batch_size=8))
    lengths = [2, 3, LONG, LONG]
    full = engine.generate(requests(lengths))
    # one group per request; the two short ones complete two: the engine aborts the stragglers itself
    with AbortBoard.create(groups=[0, 1, 2, 3], chunks=[0] * 4, need=2, lockstep=True) as board:
        out = {"r": engine.generate(requests(lengths), abort_board=board.path)}
        # sync 1 samples the prefill's token and one decode step's, each later sync one: the 3-token
        # request finished at sync 2, and the stragglers have 3 tokens
        assert board.abort_sync == 2
        assert board.finished().tolist() == [True, True, False, False]
    got = out["r"]
    # the slots differ from the first call's (its K/V stay in its slots), so the CPU's fp32 sums may
    # differ in the last bit: the same tokens, log-probs to 1e-5
    for done, whole in zip(got[:2], full[:2]):  # finished before the abort: what the call gives without one
        assert (done["token_ids"], done["finish_reason"]) == (whole["token_ids"], "length")
        assert done["logprobs"] == pytest.approx(whole["logprobs"], abs=1e-5)
    for cut, whole in zip(got[2:], full[2:]):
        n = len(cut["token_ids"])
        assert cut["finish_reason"] == "abort" and cut["num_aborts"] == 0 and n == 3
        assert cut["token_ids"] == whole["token_ids"][:n]
        assert cut["logprobs"] == pytest.approx(whole["logprobs"][:n], abs=1e-5)
        # continued with its seed on the same weights: the tokens the uninterrupted request drew
        rest = engine.generate([{"id": 0, "prompt_ids": [5 + cut["id"] % 7, 14, 6] + cut["token_ids"],
                                 "sampling": {"max_new_tokens": LONG - n, "ignore_eos": True,
                                              "seed": 100 + cut["id"]}}])[0]
        assert engine._backend.scheduler.last_stats["reused_tokens"] > 0  # its K/V stayed in its slot
        assert rest["token_ids"] == whole["token_ids"][n:] and rest["finish_reason"] == "length"
        assert rest["logprobs"] == pytest.approx(whole["logprobs"][n:], abs=1e-5)


def test_a_board_aborted_before_the_call_returns_every_request_empty_and_issues_none_again(long_ckpt):
    engine = RolloutEngine(EngineConfig(hf_checkpoint=long_ckpt, dtype="float32", max_batch_size=8))
    with AbortBoard.create(groups=[0, 1], chunks=[0, 0], need=None, lockstep=False) as board:
        board.abort()
        got = engine.generate(requests([4, 4]), abort_board=board.path)
    assert [(r["token_ids"], r["finish_reason"], r["num_aborts"]) for r in got] == [([], "abort", 0)] * 2
    with AbortBoard.create(groups=[0], chunks=[0], need=None, lockstep=False) as board, \
            pytest.raises(ValueError, match="request ids are its slots 0..0"):
        engine.generate(requests([4, 4]), abort_board=board.path)


class Prompts:
    """A prompt dataset's interface (ppo.prompts.dataset.PromptDataset: next_batch, state_dict) over a list."""

    def __init__(self, records):
        self.records, self.position = records, 0

    def next_batch(self, n):
        out = self.records[self.position:self.position + n]
        self.position += n
        return out

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def prompt(i: int, lens: list[int]) -> dict:
    return {"prompt": f"p{i}", "prompt_ids": [4 + i, 9, 6], "label": None,
            "metadata": {FORCED_LENGTHS_KEY: lens}}


PARAMS = SamplingParams(n_samples_per_prompt=2, max_new_tokens=3 * LONG, temperature=1.0, top_p=1.0, top_k=-1,
                        stop_token_ids=(EOS_ID,), seed=3)


def test_a_partial_rollout_trains_the_first_complete_groups_and_finishes_the_rest_next_step(engine_sup):
    sup, engines = engine_sup
    short, long, longer = [3, 5], [LONG, LONG], [3 * LONG, 3 * LONG]
    # step 0: four short groups and four stragglers; step 1: four longer ones behind the stragglers
    source = PartialSource(Prompts([prompt(i, short) for i in range(4)] + [prompt(i, long) for i in range(4, 8)]
                                   + [prompt(i, longer) for i in range(8, 12)]))
    run = dict(num_groups=4, over_sampling=8, decode=str, eos_id=EOS_ID, recover=recovery(sup), lockstep=True)

    first, m0 = partial_rollout(engines, [], source, PARAMS, 0, mask_offpolicy=True, **run)
    assert [s["prompt"] for s in first[::2]] == ["p0", "p1", "p2", "p3"]
    assert [len(s["response_ids"]) for s in first] == short * 4
    assert all(s["loss_mask"] == [1] * len(s["response_ids"]) and s["partial_age"] == 0 for s in first)
    assert (m0["rollout/partial_aborted_requests"], m0["rollout/partial_buffered_groups"],
            m0["rollout/partial_resumed_samples"]) == (8, 4, 0)
    buffered = [s for g in source.groups for s in g]
    assert all(0 < len(s["response_ids"]) < LONG and s["finish_reason"] is None for s in buffered)
    assert all(len(s["rollout_log_probs"]) == len(s["weight_versions"]) == len(s["response_ids"]) for s in buffered)
    carried = sum(len(s["response_ids"]) for s in buffered)
    assert m0["rollout/partial_buffered_tokens"] == carried

    # the checkpoint's copy of the buffer: JSON, floats exactly
    saved = json.loads(json.dumps(source.state_dict()))
    restored = PartialSource(Prompts([]))
    restored.load_state_dict(saved)
    assert restored.groups == source.groups and saved[BUFFER_KEY] == source.groups

    second, m1 = partial_rollout(engines, [], source, PARAMS, 1, mask_offpolicy=True, **run)
    assert [s["prompt"] for s in second[::2]] == ["p4", "p5", "p6", "p7"]  # the buffered ones, first and done
    assert (m1["rollout/partial_resumed_samples"], m1["rollout/partial_carried_tokens"],
            m1["rollout/partial_max_age"], m1["rollout/partial_resumed_groups"]) == (8, carried, 1, 4)
    plain = engines[0].generate.call(
        [{"id": i, "prompt_ids": s["prompt_ids"], "sampling": {"max_new_tokens": LONG, "ignore_eos": True,
                                                               "seed": s["sampling_seed"]}}
         for i, s in enumerate(second)]).result(60)
    for s, whole in zip(second, plain):
        n = s["partial_carried_tokens"]
        assert 0 < n < LONG and s["loss_mask"] == [0] * n + [1] * (LONG - n)  # --mask-offpolicy-in-partial-rollout
        assert s["response_ids"] == whole["token_ids"] and s["finish_reason"] == "length"
        assert s["rollout_log_probs"] == pytest.approx(whole["logprobs"], abs=1e-5)


def test_an_engine_killed_mid_rollout_is_replaced_and_its_call_replays_to_the_same_abort(
        long_ckpt, tmp_path, monkeypatch):
    """Engine 0 runs groups p0-p3 (requests 0-7 of 16: three short, one straggler), engine 1 p4-p7
    (one of 24 tokens: the abort falls after it). Engine 0 is killed once its first group is
    complete, some 20 syncs before the abort; engine 1 waits in lockstep
    while its replacement starts, and the call issued again replays its syncs: the abort lands
    where the rollout without the kill put it, on the same tokens."""
    sup = supervisor(tmp_path / "run")
    try:
        engines = spawn_engines(sup, long_ckpt)
        short, mid, long = [3, 5], [24, 24], [LONG, LONG]

        def rollout():
            lens = {3: long, 4: mid, 5: long, 6: long, 7: long}
            source = PartialSource(Prompts([prompt(i, lens.get(i, short)) for i in range(8)]))
            batch, _ = partial_rollout(engines, [], source, PARAMS, 0, num_groups=4, over_sampling=8,
                                       mask_offpolicy=False, decode=str, eos_id=EOS_ID, recover=recovery(sup),
                                       lockstep=True)
            return batch, source.groups

        want_batch, want_buffer = rollout()
        check, killed = AbortBoard.check, []

        def kill_once_p0_is_complete(board):
            if not killed and board.finished()[:2].all():
                killed.append(sup.kill("rollout-0"))
            check(board)

        monkeypatch.setattr(AbortBoard, "check", kill_once_p0_is_complete)
        batch, buffer = rollout()
        assert killed and sup.restart_counts()["rollout-0"] == 1
        assert [s["prompt"] for s in batch[::2]] == ["p0", "p1", "p2", "p4"]
        assert [len(s["response_ids"]) for s in batch] == short * 3 + mid
        assert [g[0]["prompt"]["prompt"] for g in buffer] == ["p3", "p5", "p6", "p7"]
        assert not any(s["finish_reason"] for g in buffer for s in g)
        # the replacement's fresh slots may differ from the first engine's in the last bit of an fp32 sum
        for got, want in zip(batch + [s for g in buffer for s in g], want_batch + [s for g in want_buffer for s in g]):
            assert got["response_ids"] == want["response_ids"] and len(got["response_ids"]) > 0
            assert got["rollout_log_probs"] == pytest.approx(want["rollout_log_probs"], abs=1e-5)
    finally:
        sup.shutdown()


def even_prompts(group):
    """A dynamic-sampling filter (ppo.generate.dynamic_sampling): keeps the groups of even prompts."""
    keep = int(group[0]["prompt"][1:]) % 2 == 0
    return keep, None if keep else "odd"


def test_with_dynamic_sampling_a_group_counts_once_it_passes_the_filter(engine_sup):
    sup, engines = engine_sup
    ds = DynamicSampling(num_groups=4, n_samples_per_prompt=2, over_sampling_batch_size=6, keep=even_prompts,
                         filter_path="tests.test_partial_rollout:even_prompts", max_extra_rounds=3)
    source = PartialSource(Prompts([prompt(i, [3, 4 + i % 3]) for i in range(24)]))
    batch, m = partial_rollout(engines, [], source, PARAMS, 0, num_groups=4, over_sampling=6, mask_offpolicy=False,
                               decode=str, eos_id=EOS_ID, recover=recovery(sup), lockstep=True, dynamic_sampling=ds)
    prompts = [s["prompt"] for s in batch[::2]]
    assert len(batch) == 8 and all(int(p[1:]) % 2 == 0 for p in prompts) and len(set(prompts)) == 4
    assert [s["index"] for s in batch] == list(range(8)) and [s["group_index"] for s in batch] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert m["rollout/dynamic_sampling_kept_groups"] == 4 and m["rollout/dynamic_sampling_filled_groups"] == 0
    assert m["rollout/dynamic_sampling_dropped_groups"] == m["rollout/dynamic_filter/drop_odd"] >= 2
    # every started group is trained, dropped or waiting in the buffer: none is lost
    assert 4 + m["rollout/dynamic_sampling_dropped_groups"] + len(source.groups) == source.data.position


def problems(**overrides) -> list[str]:
    return validate(override(tiny_ppo(), **overrides))


@pytest.mark.parametrize("overrides, fragment", [
    ({"mask_offpolicy_in_partial_rollout": True},
     "--mask-offpolicy-in-partial-rollout (rollout.mask_offpolicy_in_partial_rollout) is set but --partial-rollout"),
    ({"partial_rollout": True, "over_sampling_batch_size": 64},
     "--over-sampling-batch-size 64 (rollout.over_sampling_batch_size): must be >= --rollout-batch-size 128"),
    ({"partial_rollout": True, "custom_generate_function_path": "agent:generate"},
     "cannot continue the state of --custom-generate-function-path"),
    ({"partial_rollout": True, "custom_agent_function_path": "agent:run"},
     "cannot continue the state of --custom-agent-function-path"),
    ({"partial_rollout": True, "generate_tool_specs_path": "tools.json", "generate_execute_tool_function_path": "t:run",
      "dynamic_sampling_filter_path": "f:keep"}, "whose partial rollout has no sampling rounds yet"),
])
def test_partial_rollout_flags_are_checked_with_field_and_value(overrides, fragment):
    assert any(fragment in p for p in problems(**overrides)), problems(**overrides)


def test_partial_rollout_over_samples_without_a_dynamic_sampling_filter():
    assert problems(partial_rollout=True, over_sampling_batch_size=160) == []
    # the built-in tool loop's trajectories are continued (ppo.generate.partial_tools)
    assert problems(partial_rollout=True, over_sampling_batch_size=160, generate_tool_specs_path="tools.json",
                    generate_execute_tool_function_path="t:run") == []
    # sglang aborts through its abort_request (roles/rollout/sglang_backend.py); what is left is
    # that sglang needs a GPU, not this flag
    assert not any("partial" in p for p in problems(partial_rollout=True, rollout_backend="sglang"))
