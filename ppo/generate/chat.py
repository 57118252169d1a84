"""Tool calls in and tool turns out, in the model's own formats.

In: `parse_tool_calls` reads the `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
that Qwen2.5/Qwen3 and Hermes-style models write (sglang's qwen25 detector reads the same). A
block that is not such JSON, names no known tool, or is never closed becomes a `ToolCallError`,
which the tool loop answers with an error message: the model learns from it, the run goes on.

Out: `tool_turn_ids` renders tool results with the tokenizer's chat template and keeps only the
new tokens: the template's rendering of [user, assistant(tool calls)] plus the tool messages
(with the generation prompt), cut right after the assistant's end-of-turn token (or the stop
token the turn ended with, e.g. `</tool_call>` under --rollout-stop). What the
template writes after that token ("\\n" in Qwen's) belongs to the environment's turn, so the
trajectory's ids are, token for token, the template's rendering of the conversation. (miles
cuts after the whole assistant rendering instead, dropping that "\\n" from the trajectory.)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolCallError:
    message: str  # what the model is told
    name: str = "error"
    kind: str = "malformed_call"  # its error kind (roles.tools.result.ERROR_KINDS)


def parse_tool_calls(text: str, tool_names: frozenset[str]) -> list[ToolCall | ToolCallError]:
    """Every tool call block of `text`, in order; [] when the model called nothing."""
    calls: list[ToolCall | ToolCallError] = []
    for block in _BLOCK.findall(text):
        calls.append(_parse_block(block.strip(), tool_names))
    if text.count(OPEN) > text.count(CLOSE):  # cut off mid-call, or never closed
        calls.append(ToolCallError(f"error: a {OPEN} was not closed with {CLOSE}"))
    return calls


def _parse_block(body: str, tool_names: frozenset[str]) -> ToolCall | ToolCallError:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"error: the tool call is not JSON ({e.msg} at character {e.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError('error: a tool call is {"name": <tool name>, "arguments": {...}}')
    name, arguments = call["name"], call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCallError(f"error: the arguments of {name} must be a JSON object", name=name, kind="bad_arguments")
    if name not in tool_names:
        return ToolCallError(f"error: no tool named {name}; the tools are {', '.join(sorted(tool_names))}",
                             name=name, kind="unknown_tool")
    return ToolCall(name, arguments)


def tool_messages(calls: list[ToolCall | ToolCallError], contents: list[str]) -> list[dict]:
    """The chat messages of the results: one role "tool" message per call, in call order."""
    return [{"role": "tool", "name": c.name, "content": text} for c, text in zip(calls, contents, strict=True)]


def _assistant_with_calls(calls: list[ToolCall | ToolCallError]) -> dict:
    """A stand-in for the assistant turn that made the calls: the template renders the tool
    messages after it as they would follow the real one (its text is never used)."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": c.name,
                                                             "arguments": getattr(c, "arguments", {})}}
                           for c in calls]}


def tool_turn_ids(tokenizer, messages: list[dict], calls: list[ToolCall | ToolCallError], end_of_turn: int,
                  tools: list[dict] | None = None) -> list[int]:
    """The ids of the environment's turn after an assistant turn that ended with `end_of_turn`:
    the tool messages and the next assistant header, as the chat template writes them.

    The assistant turn itself may render otherwise once tool messages follow it (Qwen3's
    template gives the last assistant turn an empty thinking block, and drops it once the turn
    is not last): the trajectory keeps the model's own ids for it, so only where the turn ends
    matters. That is after as many `end_of_turn` tokens, counted from where the assistant's
    body starts, as its rendering alone holds."""
    base = [{"role": "user", "content": "x"}, _assistant_with_calls(calls)]
    head = render_ids(tokenizer, base[:1], tools, add_generation_prompt=True)
    before = render_ids(tokenizer, base, tools, add_generation_prompt=False)
    after = render_ids(tokenizer, base + messages, tools, add_generation_prompt=True)
    start = _common_prefix(head, before, after)
    if start < _common_prefix(head, before):
        raise ValueError("the chat template renders the conversation before the assistant's turn differently once "
                         "tool messages follow: the trajectory cannot be extended token by token")
    ends = before[start:].count(end_of_turn)
    if ends == 0:
        raise ValueError(f"the chat template does not end an assistant turn with token {end_of_turn} (the model's "
                         "stop token), so the tool turn cannot be placed after it")
    at = [i for i in range(start, len(after)) if after[i] == end_of_turn]
    if len(at) < ends:
        raise ValueError(f"the chat template's assistant turn holds token {end_of_turn} {ends} times, but fewer once "
                         "tool messages follow: the tool turn cannot be placed after it")
    return after[at[ends - 1] + 1:]


def _common_prefix(first: list[int], *rest: list[int]) -> int:
    """How many leading ids every list shares."""
    n = 0
    while n < len(first) and all(n < len(r) and r[n] == first[n] for r in rest):
        n += 1
    return n


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = False) -> list[int]:
    """The chat template's ids of `messages` (a list, whatever transformers' version returns)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 4.5x may return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)
