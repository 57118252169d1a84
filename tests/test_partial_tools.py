"""Partial rollouts of tool trajectories (ppo/generate/partial_tools.py, docs/partial_rollouts.md):
the cut in the trajectories' token clock, the rollback, the buffer's round trip through JSON, and
the cancellation of what runs past the cut, over a scripted engine client and tool executor whose
answers come after random delays (so that timing varies from run to run while the turns do not)."""

import asyncio
import json
import random

import pytest

from ppo.generate.custom import GenerateArgs
from ppo.generate.partial_buffer import BUFFER_KEY, PartialSource
from ppo.generate.partial_tools import partial_tool_rollout
from ppo.generate.rollout import SamplingParams
from ppo.generate.tiny_tools import TINY_TOOL_CHAT_TEMPLATE, TOOL_TOKENS, call_text
from ppo.generate.tool_loop import generate as tool_loop
from ppo.generate.tools import ToolSetup
from ppo.generate.trajectory import ENV, MODEL, Trajectory
from ppo.tiny_model import EOS_ID, build_tiny_checkpoint, load_tokenizer
from roles.tools.result import ToolResult
from tests.test_generate_tools import CALCULATOR
from tests.test_partial_rollout import Prompts

N = 2
PARAMS = SamplingParams(n_samples_per_prompt=N, max_new_tokens=2000, temperature=1.0, top_p=1.0, top_k=-1,
                        stop_token_ids=(EOS_ID,), seed=3)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tools")), extra_tokens=TOOL_TOKENS,
                                 chat_template=TINY_TOOL_CHAT_TEMPLATE, max_position_embeddings=512)
    return load_tokenizer(path)


class FreeRunning:
    """EngineClient's lockstep bookkeeping as EngineClient(lockstep=False) has it: nothing waits on it."""

    def expect(self, sample_indices):
        pass

    def done(self, sample_index):
        pass


class ScriptedEngines(FreeRunning):
    """Stands in for ppo.generate.engines.EngineClient (`generate(sample_index, prompt_ids, sampling)`
    -> {"token_ids", "logprobs", "finish_reason", "weight_version", "num_aborts"}, as
    RolloutEngine.stream answers, roles/rollout/engine.py): a turn drawn from the request's seed
    alone (the built-in engine draws from (seed, position), sampler.py), answered after a random
    delay. A turn calls the calculator or answers with 1-12 digits."""

    def __init__(self, tok, version: int, jitter: random.Random):
        self.tok, self.version, self.jitter = tok, version, jitter
        self.answered = 0
        self.tasks = []  # EngineClient's serving tasks, one per engine: none here

    async def generate(self, sample_index, prompt_ids, sampling):
        await asyncio.sleep(self.jitter.random() * 0.004)
        draw = random.Random(sampling["seed"])
        if draw.random() < 0.55:
            text = call_text(f"{draw.randint(100, 499)}+{draw.randint(100, 499)}")
        else:
            text = "".join(str(draw.randint(0, 9)) for _ in range(draw.randint(1, 12)))
        ids = (self.tok.encode(text, add_special_tokens=False) + [EOS_ID])[:sampling["max_new_tokens"]]
        self.answered += 1
        return {"token_ids": ids, "logprobs": [round(-draw.random(), 6) for _ in ids],
                "finish_reason": "stop" if ids[-1] == EOS_ID else "length", "weight_version": self.version,
                "num_aborts": 0}


class SlowCalculator:
    """The executor's interface (roles.tools.executor.ToolExecutor.call -> ToolResult), answering
    after a random delay."""

    def __init__(self, jitter: random.Random):
        self.jitter = jitter

    async def call(self, name, arguments):
        await asyncio.sleep(self.jitter.random() * 0.004)
        a, b = arguments["expression"].split("+")
        return ToolResult(str(int(a) + int(b)), True, None, 0.0)


def prompts() -> list[dict]:
    return [{"prompt": f"{100 + i}+{200 + i}=", "prompt_ids": [5 + i % 20, 9, 6], "label": None, "metadata": {}}
            for i in range(200)]


def rollouts(tok, source, steps, jitter_seed, mask=False):
    """Rollouts `steps` of 3 groups from 6 started; per step (trained rows, metrics, buffer JSON)."""
    jitter = random.Random(jitter_seed)
    calculator = SlowCalculator(jitter)
    setup = ToolSetup(tools=CALCULATOR, executor=calculator, max_turns=4, parser="qwen25")
    out = []
    for step in steps:
        engines = ScriptedEngines(tok, version=step, jitter=jitter)
        batch, metrics = partial_tool_rollout(
            lambda pump: engines, [], source, PARAMS, step, num_groups=3, over_sampling=6, mask_offpolicy=mask,
            decode=tok.decode, eos_id=EOS_ID, recover=None, generate_fn=tool_loop,
            make_args=lambda client: GenerateArgs(None, tok, 4096, client, tools=setup))
        out.append((batch, metrics, json.dumps(source.state_dict()[BUFFER_KEY], sort_keys=True)))
    return out


def trained(batch) -> list:
    keys = ("prompt", "response_ids", "loss_mask", "rollout_log_probs", "weight_versions", "stats", "num_turns",
            "partial_carried_tokens", "partial_age", "index", "group_index", "sampling_seed")
    return [{k: (s[k] if k != "stats" else {x: v for x, v in s[k].items() if x != "tool_seconds"}) for k in keys}
            for s in batch]


def test_the_cut_trains_and_buffers_the_same_trajectories_whatever_the_timing(tok):
    runs = [rollouts(tok, PartialSource(Prompts(prompts())), range(4), jitter_seed=seed) for seed in (1, 2)]
    for (a, ma, ba), (b, mb, bb) in zip(*runs):
        assert trained(a) == trained(b) and ba == bb
        assert {k: v for k, v in ma.items()} == {k: v for k, v in mb.items()}
    metrics = [m for _, m, _ in runs[0]]
    assert sum(m["rollout/partial_aborted_requests"] for m in metrics) > 0  # the cut stopped trajectories
    assert sum(m["rollout/partial_resumed_samples"] for m in metrics[1:]) > 0
    assert sum(m["rollout/partial_carried_tokens"] for m in metrics[1:]) > 0
    # a continued trajectory's tokens carry the versions that sampled them: some two
    assert any(len(set(s["weight_versions"])) == 2 for batch, _, _ in runs[0][1:] for s in batch)
    for batch, m, _ in runs[0]:
        assert len(batch) == 3 * N and [s["group_index"] for s in batch] == [0, 0, 1, 1, 2, 2]
        assert m["rollout/partial_buffered_groups"] == 3  # 6 started (the buffered first), 3 trained


def test_a_resumed_trajectory_continues_into_the_uninterrupted_one_from_the_buffers_json(tok):
    straight = rollouts(tok, PartialSource(Prompts(prompts())), range(3), jitter_seed=5)
    first = PartialSource(Prompts(prompts()))
    rollouts(tok, first, [0], jitter_seed=6)
    state = json.loads(json.dumps(first.state_dict()))  # the checkpoint's driver_state.json
    buffered = [s for g in state[BUFFER_KEY] for s in g]
    assert any(s["finish_reason"] is None and s["trajectory"]["turns"] for s in buffered)  # cut mid-way
    assert any(s["trajectory"]["turns"] and s["trajectory"]["turns"][-1]["source"] == MODEL
               and s["finish_reason"] is None for s in buffered)  # after a model turn: its tools run again
    again = PartialSource(Prompts(prompts()))
    again.load_state_dict(state)
    resumed = rollouts(tok, again, [1, 2], jitter_seed=7)
    for (want, wm, wb), (got, gm, gb) in zip(straight[1:], resumed):
        assert trained(want) == trained(got) and wb == gb and wm == gm


def test_nothing_past_the_cut_is_counted_or_lands(tok):
    """Every trained and buffered trajectory alternates model and tool turns, each tool turn the
    answer to the model turn before it; its tool_calls count its tool turns (the calls the cut
    cancelled, or whose turns it rolled back, count nowhere); carried tokens are masked with the flag."""
    source = PartialSource(Prompts(prompts()))
    steps = rollouts(tok, source, range(3), jitter_seed=11, mask=True)
    for batch, _, _ in steps:
        for s in batch:
            env_turns = sum(1 for t in s["turns"] if t["source"] == ENV)
            assert s["stats"]["tool_calls"] == env_turns
            assert s["loss_mask"][:s["partial_carried_tokens"]] == [0] * s["partial_carried_tokens"]
            assert len(s["weight_versions"]) == len(s["response_ids"]) == len(s["loss_mask"])
    for g in source.groups:
        for s in g:
            traj = Trajectory.from_state([], s["trajectory"])
            sources = [t.source for t in traj.turns]
            assert all(a != b for a, b in zip(sources, sources[1:])) and (not sources or sources[0] == MODEL)
            assert s["stats"].get("tool_calls", 0) == sources.count(ENV)


class OneCallsOneAnswers(FreeRunning):
    """Prompt "a" answers "7" after 50 ms; prompt "b" calls the calculator at once, and answers "3"
    once it has a tool turn (EngineClient's interface, as ScriptedEngines); records the contexts."""

    tasks = []

    def __init__(self, tok):
        self.tok, self.contexts = tok, []

    async def generate(self, sample_index, prompt_ids, sampling):
        self.contexts.append(list(prompt_ids))
        if prompt_ids[0] == 5:
            await asyncio.sleep(0.05)
        text = "7" if prompt_ids[0] == 5 else "3" if ENV_MARK in self.tok.decode(prompt_ids) else call_text("1+2")
        ids = self.tok.encode(text, add_special_tokens=False) + [EOS_ID]
        return {"token_ids": ids, "logprobs": [-0.1] * len(ids), "finish_reason": "stop", "weight_version": 0}


ENV_MARK = "<tool_response>"


class Hanging:
    """A tool executor whose calls never end unless cancelled."""

    def __init__(self):
        self.started = self.cancelled = 0

    async def call(self, name, arguments):
        self.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@pytest.mark.timeout(30)
def test_the_cut_cancels_a_tool_call_in_flight_and_its_trajectory_runs_it_again_later(tok):
    """Group 0 completes at clock 2 while group 1's trajectory waits on a tool call: the cut cancels
    the call, counts nothing, and buffers the trajectory after its model turn (the call runs again
    when it continues); no reward is asked for it."""
    hanging = Hanging()
    setup = ToolSetup(tools=CALCULATOR, executor=hanging, max_turns=4, parser="qwen25")
    records = [{"prompt": p, "prompt_ids": [i, 9, 6], "label": None, "metadata": {}} for p, i in (("a", 5), ("b", 6))]
    source = PartialSource(Prompts(records))
    engines = OneCallsOneAnswers(tok)
    params = SamplingParams(n_samples_per_prompt=1, max_new_tokens=200, temperature=1.0, top_p=1.0, top_k=-1,
                            stop_token_ids=(EOS_ID,), seed=3)

    def rollout(step: int, setup: ToolSetup, over_sampling: int):
        return partial_tool_rollout(
            lambda pump: engines, [], source, params, step, num_groups=1, over_sampling=over_sampling,
            mask_offpolicy=False, decode=tok.decode, eos_id=EOS_ID, recover=None, generate_fn=tool_loop,
            make_args=lambda client: GenerateArgs(None, tok, 4096, client, tools=setup))

    batch, metrics = rollout(0, setup, over_sampling=2)
    assert [s["prompt"] for s in batch] == ["a"] and batch[0]["reward"] == 0.0  # scored: the trained group only
    assert (hanging.started, hanging.cancelled) == (1, 1)
    assert metrics["rollout/partial_aborted_requests"] == 1 and metrics["rollout/partial_buffered_groups"] == 1
    [[cut]] = source.groups
    assert cut["finish_reason"] is None and cut["stats"]["tool_calls"] == 0
    assert [t["source"] for t in cut["trajectory"]["turns"]] == [MODEL]

    # continued: the call runs again (and is counted once), then the model answers
    calculator = ToolSetup(tools=CALCULATOR, executor=SlowCalculator(random.Random(0)), max_turns=4, parser="qwen25")
    asked = len(engines.contexts)
    batch, metrics = rollout(1, calculator, over_sampling=1)
    [row] = batch
    assert row["prompt"] == "b" and [t["source"] for t in row["turns"]] == [MODEL, ENV, MODEL]
    assert row["stats"]["tool_calls"] == 1 and row["partial_carried_tokens"] == len(cut["trajectory"]["turns"][0]["ids"])
    assert row["response"].endswith("</tool_response>3") and len(engines.contexts) == asked + 1  # one new turn
    assert metrics["rollout/partial_resumed_samples"] == 1 and metrics["rollout/partial_aborted_requests"] == 0


def test_a_trajectory_round_trips_through_json_with_its_weight_versions():
    traj = Trajectory([1, 2])
    traj.add_model_turn([3, 4], [-0.1, -1 / 3], "stop", weight_version=2)
    traj.add_env_turn([5])
    traj.add_model_turn([6], [-2.5e-17], "length", weight_version=3)
    back = Trajectory.from_state([1, 2], json.loads(json.dumps(traj.state())))
    assert back == traj and back.rollout_log_probs == [-0.1, -1 / 3, 0.0, -2.5e-17]  # floats exactly
    assert back.weight_versions == [2, 2, 2, 3] and back.loss_mask == [1, 1, 0, 1]
    traj.add_model_turn([7], [-1.0], "stop")  # an engine result without a version
    with pytest.raises(ValueError, match="without its weight version"):
        traj.weight_versions
