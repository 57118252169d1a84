"""The tiny tool format: a calculator the tiny model calls, in Qwen's `<tool_call>{json}</tool_call>`.

The character-level tiny tokenizer (ppo.tiny_model) gets the markup as whole tokens, as real
tokenizers have them (Qwen3's <tool_call> is one token), plus the fixed JSON around the one
argument, so that a call fits the tiny model's 64 positions:

    347+285= <tool_call>{"name": "calc", "arguments": {"expr": "347+285"}}</tool_call><eos>
             <tool_response>632</tool_response>632<eos>

TINY_TOOL_CHAT_TEMPLATE renders that conversation (user text as is; the assistant's text and
calls, then <eos>; a tool's answer in <tool_response> tags; no generation prompt), so the tool
loop's tool turns come from the model's own template like any other model's.
"""

from __future__ import annotations

import re

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               '{"name": "', '", "arguments": {"expr": "', '"}}')
TINY_TOOL_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- m.content -}}"
    "{%- for c in m.tool_calls | default([]) -%}<tool_call>{{- c.function | tojson -}}</tool_call>{%- endfor -%}"
    "<eos>"
    "{%- elif m.role == 'tool' -%}<tool_response>{{- m.content -}}</tool_response>"
    "{%- else -%}{{- m.content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
CALC_SPEC = {"type": "function", "function": {
    "name": "calc", "description": "adds, subtracts or multiplies integers: '347+285'",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}
TOOL_SPECS = [CALC_SPEC]
_EXPR = re.compile(r"\s*(-?\d{1,12})\s*([+\-*])\s*(-?\d{1,12})\s*")


async def execute(name: str, arguments: dict) -> str:
    """The calculator: one binary operation on integers; anything else raises (the model is told)."""
    if name != "calc":
        raise ValueError(f"unknown tool {name}")
    match = _EXPR.fullmatch(str(arguments.get("expr", "")))
    if match is None:
        raise ValueError("expr must be like 347+285")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def call_text(expr: str) -> str:
    """What the model writes to call the calculator on `expr` (the template's rendering)."""
    return '<tool_call>{"name": "calc", "arguments": {"expr": "' + expr + '"}}</tool_call>'
