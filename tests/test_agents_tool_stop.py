"""A model turn that stops at `</tool_call>` (--rollout-stop, the tiny_tools recipes) gives the same
record through the session server (the tiny agent over the real openai client) as through the
built-in tool loop: same turns, ids, log-probs and loss masks, nothing split. Without the stop, a
model that writes text after its call (seen at seed 1 of tiny_tools_agent, docs/agents.md) splits
the agent's session, since an OpenAI assistant message cannot hold text after its tool calls."""

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("openai", reason="the openai client (in .[test]); the GPU image lacks it")

from ppo.config import ToolsConfig
from ppo.config.recipes import tiny_tools, tiny_tools_agent, tiny_tools_no_tool
from ppo.generate.agents.agent import AgentArgs, agent_generate_function
from ppo.generate.agents.tiny_agent import run_agent
from ppo.generate.chat import render_ids
from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.stops import stop_token_ids
from ppo.generate.tiny_tools import TINY_TOOL_CHAT_TEMPLATE, TOOL_TOKENS, call_text
from ppo.generate.tool_loop import generate as tool_loop
from ppo.generate.tools import ToolSetup, tool_limits
from ppo.generate.trajectory import ENV, MODEL
from ppo.tiny_model import EOS_ID, build_tiny_checkpoint, load_tokenizer
from roles.tools.calculator import TOOL_SPECS
from roles.tools.in_process import InProcessExecutor
from roles.tools.specs import ToolSet

pytestmark = pytest.mark.timeout(60)

PROMPT = "347+285="
QWEN_CALL = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "347+285"}}\n</tool_call>'


@dataclasses.dataclass(frozen=True)
class Case:
    """A tokenizer with its chat template, and what its model writes in each turn before its end
    of turn (`end`, a stop token): a call with text after it, then the answer."""

    tok: object
    writes: tuple[str, ...]
    end: str
    max_context: int
    max_new_tokens: int


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tools")), extra_tokens=TOOL_TOKENS,
                                 chat_template=TINY_TOOL_CHAT_TEMPLATE)
    return Case(load_tokenizer(path), (call_text("347+285") + "150", "632"), "<eos>", 64, 30)  # tiny_tools' limits


@pytest.fixture(scope="module")
def qwen_like(qwen_tok):
    """Qwen's layout (tests/test_generate_tools.py QWEN_LIKE_TEMPLATE: "\\n" after <|im_end|>, tool
    results in a user turn). Qwen3's real template is held by tests/test_generate_tools.py (the tool
    loop) and tests/test_agents_tokens.py (the session server)."""
    return Case(qwen_tok, (QWEN_CALL + "\nthe sum is 150", "the answer is 632"), "<|im_end|>", 512, 200)


class Model:
    """Stands in for the engines behind both paths: the tool loop's `client.generate(sample_index,
    prompt_ids, sampling)` (ppo/generate/engines.py EngineClient.generate) and the session's engine
    (called with the same arguments, ppo/generate/agents/agent.py). Each turn is the next scripted
    text then the model's eos, ended as the engines end it (roles/rollout/sampling.py; the torch
    engine's scheduler.py stops a row on a token of `stop_token_ids` or eos): at the first stop
    token, which stays in the response. One log-prob per id; the contexts asked are recorded."""

    def __init__(self, case):
        self.tok, self.writes, self.end, self.contexts = case.tok, list(case.writes), case.end, []

    async def generate(self, sample_index, prompt_ids, sampling):
        self.contexts.append(list(prompt_ids))
        ids = self.tok.encode(self.writes.pop(0) + self.end, add_special_tokens=False)
        stops = {*sampling["stop_token_ids"], self.tok.eos_token_id}
        ids = ids[:next(i for i, t in enumerate(ids) if t in stops) + 1]
        return {"token_ids": ids, "logprobs": [-0.1 * (i + 1) for i in range(len(ids))], "finish_reason": "stop",
                "weight_version": 3, "num_aborts": 0}

    __call__ = generate


def sampling(case, stop_ids):
    """The rollout's sampling params as both paths get them (ppo/loop.py sampling_params), with
    the model's end of turn among the stop tokens."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": case.max_new_tokens, "seed": 5,
            "stop_token_ids": [*stop_ids, case.tok.convert_tokens_to_ids(case.end)]}


def sample(case):
    """The prompt as the agent's first request renders it (the calculator's spec in the system
    prompt where the template writes one), so that both paths start from the same ids."""
    messages = [{"role": "user", "content": PROMPT}]
    return Sample(index=0, group_index=0, prompt=PROMPT, messages=messages,
                  prompt_ids=render_ids(case.tok, messages, TOOL_SPECS, add_generation_prompt=True))


def through_the_tool_loop(case, params):
    model = Model(case)
    calculator = ToolSet(specs=tuple(TOOL_SPECS), function_path="roles.tools.calculator:execute_tool")
    executor = InProcessExecutor(calculator, tool_limits(SimpleNamespace(tools=ToolsConfig())), num_workers=1)
    tools = ToolSetup(tools=calculator, executor=executor, max_turns=2, parser="qwen25")  # tiny_tools' max turns
    try:
        args = GenerateArgs(config=None, tokenizer=case.tok, max_context=case.max_context, client=model, tools=tools)
        return asyncio.run(tool_loop(args, sample(case), params)), model
    finally:
        tools.close()


def through_the_session_server(case, params):
    model = Model(case)

    async def main():
        args = AgentArgs(config=None, tokenizer=case.tok, max_context=case.max_context, client=model)
        try:
            return await agent_generate_function(run_agent)(args, sample(case), params)
        finally:
            await args.aclose()

    return asyncio.run(main()), model


@pytest.mark.parametrize("name", ["tiny", "qwen_like"])
def test_a_turn_stopped_at_the_tool_call_round_trips_through_the_session_server_as_through_the_tool_loop(name, request):
    case = request.getfixturevalue(name)
    tok = case.tok
    params = sampling(case, stop_token_ids(tiny_tools_agent(), tok))  # --rollout-stop '</tool_call>'
    loop, loop_model = through_the_tool_loop(case, params)
    records, agent_model = through_the_session_server(case, params)
    assert len(records) == 1 and records[0].stats["agent_splits"] == 0
    traj = records[0].trajectory
    assert traj.turns == loop.trajectory.turns  # sources, ids, log-probs, finish reasons
    assert traj.ids == loop.trajectory.ids and traj.loss_mask == loop.trajectory.loss_mask
    assert agent_model.contexts == loop_model.contexts  # the engine is asked the same contexts
    assert [t.source for t in traj.turns] == [MODEL, ENV, MODEL] and len(agent_model.contexts) == 2
    texts = [tok.decode(list(t.ids), skip_special_tokens=False) for t in traj.turns]
    # the call turn ends at its stop token; the template's end of turn opens the tool's turn
    assert texts[0].endswith("</tool_call>") and texts[1].startswith(case.end)
    assert "632" in texts[1] and texts[2] == case.writes[1] + case.end


def test_without_the_stop_text_after_a_call_splits_the_agents_session(tiny):
    tok, params = tiny.tok, sampling(tiny, [EOS_ID])
    loop, loop_model = through_the_tool_loop(tiny, params)
    records, agent_model = through_the_session_server(tiny, params)
    # the tool loop keeps the model's "150<eos>"; the agent's next request renders the call without
    # it (an OpenAI message holds no text after its calls), so it continues no record
    assert records[-1].stats["agent_splits"] == 1 and len(records) == 2
    assert records[0].trajectory.turns == loop.trajectory.turns[:1]
    call, response = PROMPT + call_text("347+285"), "<tool_response>632</tool_response>"
    assert [tok.decode(c, skip_special_tokens=False) for c in loop_model.contexts[1:]] == [call + "150<eos>" + response]
    assert [tok.decode(c, skip_special_tokens=False) for c in agent_model.contexts[1:]] == [call + "<eos>" + response]
    assert records[-1].trajectory.prompt_ids == agent_model.contexts[1]  # a new record from the whole prompt


def test_rollout_stop_strings_are_one_token_each_or_refused_naming_the_flag(tiny):
    tok = tiny.tok
    assert stop_token_ids(tiny_tools(), tok) == (EOS_ID, tok.convert_tokens_to_ids("</tool_call>"))
    assert stop_token_ids(tiny_tools_no_tool(), tok) == (EOS_ID,)  # its model has no tool tokens
    both = dataclasses.replace(tiny_tools(), rollout=dataclasses.replace(
        tiny_tools().rollout, rollout_stop_token_ids=(EOS_ID, 7), rollout_stop=("</tool_call>", "=")))
    assert stop_token_ids(both, tok) == (EOS_ID, 7, tok.convert_tokens_to_ids("</tool_call>"), tok.encode("=")[0])
    bad = dataclasses.replace(tiny_tools(), rollout=dataclasses.replace(tiny_tools().rollout, rollout_stop=("</x>",)))
    with pytest.raises(ValueError, match=r"--rollout-stop '</x>': .* as 4 tokens"):
        stop_token_ids(bad, tok)
