"""The built-in tool loop: tool-call parsing, tool turns from the chat template, the tool setup's
checks, the in-process executor, and the loop itself over a scripted engine client."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from ppo.generate.chat import ToolCall, ToolCallError, parse_tool_calls, render_ids, tool_messages, tool_turn_ids
from ppo.generate.custom import GenerateArgs, Sample
from ppo.generate.tiny_tools import TINY_TOOL_CHAT_TEMPLATE, TOOL_SPECS, TOOL_TOKENS, call_text, execute
from ppo.generate.tool_loop import generate as tool_loop
from ppo.generate.tools import InProcessExecutor, ToolSetup, check_chat_template, load_tool_setup
from ppo.setup.tiny_model import EOS_ID, build_tiny_checkpoint, load_tokenizer

NAMES = frozenset({"calc", "search"})
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


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    path = build_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen")), extra_tokens=(
        "<|im_start|>", "<|im_end|>", "\n", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
        '"', "{", "}", ":", ","), chat_template=QWEN_LIKE_TEMPLATE)
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
    calls = [ToolCall("calc", {"expr": expr})]
    return calls, [{"role": "user", "content": f"{expr}="},
                   {"role": "assistant", "content": "", "tool_calls": [
                       {"type": "function", "function": {"name": "calc", "arguments": {"expr": expr}}}]},
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


def test_a_template_that_cannot_render_tool_turns_is_refused(tok, tmp_path):
    setup = ToolSetup(specs=TOOL_SPECS, executor=None, max_turns=4, parser="qwen25")
    check_chat_template(tok, setup)
    tok2 = load_tokenizer(build_tiny_checkpoint(str(tmp_path / "t"), extra_tokens=TOOL_TOKENS))
    with pytest.raises(ValueError, match="has none"):
        check_chat_template(tok2, setup)
    tok2.chat_template = "{{ messages | length }}"  # renders the count: a changed prefix, no stop token
    with pytest.raises(ValueError, match="cannot render a tool turn"):
        check_chat_template(tok2, setup)


def _config(tmp_path, specs="ppo.generate.tiny_tools:TOOL_SPECS", fn="ppo.generate.tiny_tools:execute"):
    return SimpleNamespace(generate_tool_specs_path=specs, generate_execute_tool_function_path=fn,
                           generate_max_turns=3, generate_tool_call_parser="qwen25")


def test_tool_setup_loads_specs_and_function_and_refuses_bad_ones_in_one_line(tmp_path):
    setup = load_tool_setup(_config(tmp_path))
    assert setup.names == {"calc"} and setup.max_turns == 3
    f = tmp_path / "t.py"
    f.write_text("SPECS = [{'type': 'function', 'function': {'name': 'a'}}]\nBAD = [{'type': 'function'}]\n"
                 "def specs():\n    return SPECS\n"
                 "def sync(name, arguments):\n    return ''\nasync def one(name):\n    return ''\n")
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert load_tool_setup(_config(tmp_path, specs=f"{f}:specs")).names == {"a"}
    cases = [(f"{f}:BAD", "ppo.generate.tiny_tools:execute", "spec #0 must be"),
             (f"{f}:missing", "ppo.generate.tiny_tools:execute", "has no attribute 'missing'"),
             (f"{tmp_path}/broken.py:f", "ppo.generate.tiny_tools:execute", "importing it raised SyntaxError"),
             ("ppo.generate.tiny_tools:TOOL_SPECS", f"{f}:sync", "must be an async def execute"),
             ("ppo.generate.tiny_tools:TOOL_SPECS", f"{f}:one", r"one\(name\) must take \(name, arguments\)")]
    for specs, fn, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            load_tool_setup(_config(tmp_path, specs=specs, fn=fn))
        assert "\n" not in str(e.value)


def test_in_process_executor_turns_failures_into_messages_for_the_model():
    async def tool(name, arguments):
        if name == "slow":
            await asyncio.sleep(5)
        if name == "boom":
            raise RuntimeError("bad input")
        if name == "number":
            return 3
        return "x" * 50

    ex = InProcessExecutor(tool, timeout_s=0.05, max_chars=10)
    slow, boom, number, long = asyncio.run(_all(ex.call(n, {}) for n in ("slow", "boom", "number", "long")))
    assert (slow.ok, slow.error_kind) == (False, "timeout") and "longer than 0.05 s" in slow.text
    assert (boom.error_kind, boom.text) == ("error", "error: boom raised RuntimeError: bad input")
    assert number.error_kind == "error" and "returned int" in number.text
    assert long.ok and long.text == "x" * 10 + "... (cut at 10 characters)"
    assert asyncio.run(execute("calc", {"expr": "347+285"})) == "632"


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
    setup = ToolSetup(specs=TOOL_SPECS, executor=InProcessExecutor(execute), max_turns=max_turns, parser="qwen25")
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
    assert out.stats == {"tool_calls": 1, "tool_errors": 0, "tool_timeouts": 0, "tool_seconds": pytest.approx(0, abs=1)}
    assert out.weight_version == 7 and traj.num_model_turns == 2


def test_tool_loop_answers_a_malformed_call_with_an_error_and_stops_at_the_turn_limit(tok):
    bad = _ids(tok, '<tool_call>{"name": "calc", "arguments": {"expr": "1+"}}</tool_call>')  # calc raises
    worse = _ids(tok, "<tool_call>calc</tool_call>")  # not JSON
    out, client = _run_loop(tok, [(bad, "stop"), (worse, "stop"), (bad, "stop")], max_turns=3,
                            max_new_tokens=400, max_context=512)  # room for the error messages
    texts = [tok.decode(list(t.ids), skip_special_tokens=False) for t in out.trajectory.turns]
    assert [t.source for t in out.trajectory.turns] == ["model", "env", "model", "env", "model"]
    assert texts[1].startswith("<tool_response>error<unk> calc raised valueerror")
    assert texts[3].startswith("<tool_response>error<unk> the tool call is not json")
    assert out.stats["tool_calls"] == 2 and out.stats["tool_errors"] == 2  # the 3rd turn's call is not run
    assert not client.turns


def test_tool_loop_stops_on_length_and_when_the_result_would_not_fit(tok):
    call = _ids(tok, call_text("347+285"))
    out, _ = _run_loop(tok, [(call[:-1], "length")])
    assert out.trajectory.num_model_turns == 1 and out.trajectory.num_env_tokens == 0
    out, _ = _run_loop(tok, [(call, "stop")], max_new_tokens=len(call) + 3)  # the 5-token result does not fit
    assert out.trajectory.turns[-1].source == "model" and out.stats["tool_calls"] == 1
