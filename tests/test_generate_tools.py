"""The built-in tool loop: tool-call parsing, tool turns from the chat template, the tool setup's
checks, the in-process executor, and the loop itself over a scripted engine client (faults of
the tools under both executors: tests/test_tool_loop_faults.py)."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from ppo.generate.chat import ToolCall, ToolCallError, parse_tool_calls, render_ids, tool_messages, tool_turn_ids
from ppo.generate.custom import GenerateArgs, Sample
from ppo.config import ToolsConfig
from ppo.generate.tiny_tools import TINY_TOOL_CHAT_TEMPLATE, TOOL_TOKENS, call_text
from ppo.generate.tool_loop import generate as tool_loop
from ppo.generate.tools import ToolSetup, check_chat_template, load_tool_setup, tool_limits
from ppo.tiny_model import EOS_ID, build_tiny_checkpoint, load_tokenizer
from roles.tools.calculator import TOOL_SPECS
from roles.tools.in_process import InProcessExecutor
from roles.tools.specs import ToolSet
from tests.chat_tokenizers import qwen3_tokenizer

NAMES = frozenset({"calc", "search"})
CALCULATOR = ToolSet(specs=tuple(TOOL_SPECS), function_path="roles.tools.calculator:execute_tool")
# Qwen2.5/Qwen3's layout of tool turns (consecutive tool messages in one user turn, "\n" after
# <|im_end|>), written for the tiny tokenizer's characters
QWEN_LIKE_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls | default([]) %}{{- '\\n<tool_call>\\n' + (c.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("tools")), extra_tokens=TOOL_TOKENS,
                                 chat_template=TINY_TOOL_CHAT_TEMPLATE)
    return load_tokenizer(path)


def test_tool_calls_are_parsed_in_order_and_malformed_ones_become_errors():
    text = ('think <tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
            '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>')
    assert parse_tool_calls(text, NAMES) == [ToolCall("calc", {"expr": "1+2"}), ToolCall("search", {"q": "x"})]
    assert parse_tool_calls("no call here", NAMES) == []
    bad = parse_tool_calls('<tool_call>{"name": calc}</tool_call><tool_call>{"name": "rm", "arguments": {}}'
                           '</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "calc", "arguments": 3}'
                           '</tool_call><tool_call>{"name": "calc"', NAMES)
    assert [type(c) for c in bad] == [ToolCallError] * 5
    assert bad[0].message.startswith("error: the tool call is not JSON")
    assert bad[1].message == "error: no tool named rm; the tools are calc, search"
    assert "arguments of calc must be a JSON object" in bad[3].message
    assert bad[4].message == "error: a <tool_call> was not closed with </tool_call>"


def _conversation(expr: str, answer: str):
    calls = [ToolCall("calculator", {"expression": expr})]
    return calls, [{"role": "user", "content": f"{expr}="},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}]},
                   *tool_messages(calls, [answer])]


def test_trajectory_of_model_ids_and_tool_turns_is_the_chat_templates_rendering(tok):
    calls, messages = _conversation("347+285", "632")
    prompt = tok.encode("347+285=", add_special_tokens=False)
    model = tok.encode(call_text("347+285"), add_special_tokens=False) + [EOS_ID]  # as if the model wrote it
    env = tool_turn_ids(tok, messages[2:], calls, end_of_turn=EOS_ID, tools=TOOL_SPECS)
    assert tok.decode(env, skip_special_tokens=False) == "<tool_response>632</tool_response>"
    assert prompt + model + env == render_ids(tok, messages, TOOL_SPECS, add_generation_prompt=True)


def test_tool_turn_keeps_what_the_template_writes_after_the_stop_token(qwen_tok):
    """Qwen's template writes "\\n" after <|im_end|>; the model stops at <|im_end|>, so the "\\n"
    opens the environment's turn, and two results share one user turn."""
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    calls = [ToolCall("calc", {"expr": "1+2"}), ToolCallError("error: no tool named rm", name="rm")]
    env = tool_turn_ids(qwen_tok, tool_messages(calls, ["3", "oops"]), calls, end_of_turn=im_end)
    assert qwen_tok.decode(env, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\noops\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "a", "tool_calls": [
                    {"type": "function", "function": {"name": "calc", "arguments": {"expr": "1+2"}}},
                    {"type": "function", "function": {"name": "rm", "arguments": {}}}]}]
    before = render_ids(qwen_tok, messages)
    after = render_ids(qwen_tok, messages + tool_messages(calls, ["3", "oops"]), add_generation_prompt=True)
    cut = len(before) - 1  # the "\n" after the assistant's <|im_end|>
    assert before[cut - 1] == im_end and after[cut:] == env


def test_qwen3s_own_template_renders_the_tool_turn_after_a_thinking_turn():
    """Qwen3's template (tests/fixtures/chat_templates) gives the last assistant turn an empty
    thinking block and drops it once tool messages follow; the tool turn is still cut right
    after the assistant's <|im_end|>, whatever the model's turn held."""
    tok = qwen3_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    check_chat_template(tok, ToolSetup(tools=CALCULATOR, executor=None, max_turns=4, parser="qwen25"))
    calls = [ToolCall("calculator", {"expression": "1+2"})]
    env = tool_turn_ids(tok, tool_messages(calls, ["3"]), calls, end_of_turn=im_end, tools=TOOL_SPECS)
    assert tok.decode(env, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # the whole conversation as the template writes it: the prompt, the assistant turn, then exactly env
    user = [{"role": "user", "content": "1+2="}]
    prompt = render_ids(tok, user, TOOL_SPECS, add_generation_prompt=True)
    whole = render_ids(tok, user + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1+2"}}}]}]
        + tool_messages(calls, ["3"]), TOOL_SPECS, add_generation_prompt=True)
    assert whole[:len(prompt)] == prompt and whole[-len(env):] == env
    assert whole[-len(env) - 1] == im_end


def test_a_template_that_cannot_render_tool_turns_is_refused(tok, tmp_path):
    setup = ToolSetup(tools=CALCULATOR, executor=None, max_turns=4, parser="qwen25")
    check_chat_template(tok, setup)
    tok2 = load_tokenizer(build_tiny_checkpoint(str(tmp_path / "t"), extra_tokens=TOOL_TOKENS))
    with pytest.raises(ValueError, match="has none"):
        check_chat_template(tok2, setup)
    tok2.chat_template = "{{ messages | length }}"  # renders the count: a changed prefix, no stop token
    with pytest.raises(ValueError, match="cannot render a tool turn"):
        check_chat_template(tok2, setup)


def _config(specs="roles.tools.calculator:TOOL_SPECS", fn="roles.tools.calculator:execute_tool", sandbox=False):
    generate = SimpleNamespace(generate_tool_specs_path=specs, generate_execute_tool_function_path=fn,
                               generate_max_turns=3, generate_tool_call_parser="qwen25")
    return SimpleNamespace(generate=generate,
                           tools=ToolsConfig(tool_sandbox=sandbox, num_tool_workers=1))


def test_tool_setup_loads_specs_and_function_and_refuses_bad_ones_in_one_line(tmp_path):
    setup = load_tool_setup(_config())
    try:
        assert setup.names == {"calculator"} and setup.max_turns == 3
        assert isinstance(setup.executor, InProcessExecutor)  # --no-tool-sandbox
    finally:
        setup.close()
    f = tmp_path / "t.py"
    f.write_text("SPECS = [{'type': 'function', 'function': {'name': 'a'}}]\nBAD = [{'type': 'function'}]\n"
                 "def specs():\n    return SPECS\n"
                 "def sync(name, arguments):\n    return ''\nasync def one(name):\n    return ''\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    setup = load_tool_setup(_config(specs=f"{f}:specs", fn=f"{f}:sync"))  # a function of specs; a sync tool
    assert setup.names == {"a"}
    setup.close()
    cases = [(f"{f}:BAD", "tool 0: expected"),
             (f"{f}:missing", "has no attribute 'missing'"),
             (f"{tmp_path}/broken.py:f", "importing it failed: SyntaxError")]
    for specs, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            load_tool_setup(_config(specs=specs))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"one\(name\) cannot be called with \(name, arguments\)"):
        load_tool_setup(_config(fn=f"{f}:one"))


def test_in_process_executor_turns_failures_into_messages_for_the_model(tmp_path):
    (tmp_path / "tool.py").write_text(
        "import asyncio, time\n"
        "def execute(name, arguments):\n"
        "    what = arguments['what']\n"
        "    if what == 'slow':\n        time.sleep(1)\n"
        "    if what == 'boom':\n        raise RuntimeError('bad input')\n"
        "    if what == 'number':\n        return 3\n"
        "    return 'x' * 50\n"
        "async def execute_async(name, arguments):\n    await asyncio.sleep(5)\n")
    spec = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"what": {"type": "string"}}, "required": ["what"]}}}
    limits = tool_limits(SimpleNamespace(tools=ToolsConfig(tool_timeout=0.05, tool_max_output_chars=10)))
    ex = InProcessExecutor(ToolSet(specs=(spec,), function_path=f"{tmp_path}/tool.py:execute"), limits, num_workers=2)
    try:
        slow, boom, number, long, bad = asyncio.run(_all(
            [ex.call("t", {"what": w}) for w in ("slow", "boom", "number", "long")] + [ex.call("t", {})]))
    finally:
        ex.close()
    assert (slow.ok, slow.error_kind) == (False, "timeout") and "longer than 0.05 s" in slow.text
    assert boom.error_kind == "crash" and boom.text.startswith("error: RuntimeError: bad input (at tool.py:")
    assert number.error_kind == "crash" and "returned a int, not a str" in number.text
    assert (long.ok, long.error_kind) == (False, "output_limit")
    assert long.text == "x" * 10 + "\n[output cut: 50 characters, the limit is 10]"
    assert (bad.error_kind, bad.seconds) == ("bad_arguments", 0.0)
    assert ex.stats()["tool_calls"] == 5 and ex.stats()["tool_timeouts"] == 1 and ex.stats()["tool_errors"] == 5
    ex = InProcessExecutor(ToolSet(specs=(spec,), function_path=f"{tmp_path}/tool.py:execute_async"), limits,
                           num_workers=1)
    assert asyncio.run(ex.call("t", {"what": "x"})).error_kind == "timeout"  # an async tool: on the event loop
    ex.close()


async def _all(coros):
    return await asyncio.gather(*coros)


class ScriptedClient:
    """Stands in for ppo.generate.engines.EngineClient: `generate(sample_index, prompt_ids, sampling)`
    returns the engine's result dict ({"token_ids", "logprobs", "finish_reason", "weight_version"},
    roles/rollout/engine.py RolloutEngine.generate), here the next scripted turn; it records the
    context each turn was asked with."""

    def __init__(self, turns):
        self.turns, self.contexts = list(turns), []

    async def generate(self, sample_index, prompt_ids, sampling):
        self.contexts.append(list(prompt_ids))
        ids, finish = self.turns.pop(0)
        return {"token_ids": ids, "logprobs": [-0.5] * len(ids), "finish_reason": finish, "weight_version": 7}


def _run_loop(tok, turns, max_turns=4, max_new_tokens=60, max_context=64):
    client = ScriptedClient(turns)
    limits = tool_limits(SimpleNamespace(tools=ToolsConfig()))
    setup = ToolSetup(tools=CALCULATOR, executor=InProcessExecutor(CALCULATOR, limits, num_workers=1),
                      max_turns=max_turns, parser="qwen25")
    args = GenerateArgs(config=None, tokenizer=tok, max_context=max_context, client=client, tools=setup)
    sample = Sample(index=0, group_index=0, prompt="347+285=", prompt_ids=tok.encode("347+285=",
                                                                                        add_special_tokens=False))
    out = asyncio.run(tool_loop(args, sample, {"max_new_tokens": max_new_tokens, "seed": 1}))
    return out, client


def _ids(tok, text, eos=True):
    return tok.encode(text, add_special_tokens=False) + ([EOS_ID] if eos else [])


def test_tool_loop_runs_the_call_appends_the_rendered_result_and_asks_with_the_whole_record(tok):
    call, answer = _ids(tok, call_text("347+285")), _ids(tok, "632")
    out, client = _run_loop(tok, [(call, "stop"), (answer, "stop")])
    traj = out.trajectory
    env = _ids(tok, "<tool_response>632</tool_response>", eos=False)
    assert traj.response_ids == call + env + answer
    assert traj.loss_mask == [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert client.contexts == [out.prompt_ids, out.prompt_ids + call + env]  # each turn: the record so far
    assert out.stats == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_seconds": pytest.approx(0, abs=1),
                         "tool_worker_restarts": 0}
    assert out.weight_version == 7 and traj.num_model_turns == 2


def test_tool_loop_answers_a_malformed_call_with_an_error_and_stops_at_the_turn_limit(tok):
    bad = _ids(tok, call_text("1+"))  # the calculator answers with its error, in words
    worse = _ids(tok, "<tool_call>calc</tool_call>")  # not JSON
    out, client = _run_loop(tok, [(bad, "stop"), (worse, "stop"), (bad, "stop")], max_turns=3,
                            max_new_tokens=400, max_context=512)  # room for the error messages
    texts = [tok.decode(list(t.ids), skip_special_tokens=False) for t in out.trajectory.turns]
    assert [t.source for t in out.trajectory.turns] == ["model", "env", "model", "env", "model"]
    assert texts[1].startswith("<tool_response>error<unk> <unk>1+<unk> is not an arithmetic expression")
    assert texts[3].startswith("<tool_response>error<unk> the tool call is not json")
    assert out.stats["tool_calls"] == 2 and out.stats["tool_errors"] == 1  # the 3rd turn's call is not run
    assert out.stats["tool_errors/malformed_call"] == 1
    assert not client.turns


def test_tool_loop_stops_on_length_and_when_the_result_would_not_fit(tok):
    call = _ids(tok, call_text("347+285"))
    out, _ = _run_loop(tok, [(call[:-1], "length")])
    assert out.trajectory.num_model_turns == 1 and out.trajectory.num_env_tokens == 0
    out, _ = _run_loop(tok, [(call, "stop")], max_new_tokens=len(call) + 3)  # the 5-token result does not fit
    assert out.trajectory.turns[-1].source == "model" and out.stats["tool_calls"] == 1
