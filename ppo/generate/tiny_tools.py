"""The tiny tool format: a calculator the tiny model calls, in Qwen's `<tool_call>{json}</tool_call>`.

The character-level tiny tokenizer (ppo.setup.tiny_model) gets the markup as whole tokens, as real
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


def answer_reward(sample: dict) -> float:
    """--custom-rm-path of tiny_tools: the answer after the last tool result (the whole response
    when there is none), graded digit by digit as tiny_digits grades a direct answer."""
    from roles.reward.rules import tiny_digits_reward

    answer = sample["response"].rpartition("</tool_response>")[2]
    return tiny_digits_reward(answer, str(sample["label"]))


# -- the warm start: the call format, not the answers --------------------------------------

WARM_START_STEPS = 300
ANSWER_DIGITS = 3


def build_tool_model(path: str, prompts: list[str], *, seed: int, steps: int = WARM_START_STEPS) -> None:
    """A tiny model that knows the call format: teacher-forced on "prompt -> the calculator call on
    the prompt's expression, <eos>" and, after the tool's (true) result, "-> three random digits,
    <eos>". It calls the tool right and answers by chance: using the result is left to PPO."""
    import random

    import torch

    from ppo.setup.tiny_model import EOS_ID, build_tiny_checkpoint, load_causal_lm, load_tokenizer

    build_tiny_checkpoint(path, seed=seed, extra_tokens=TOOL_TOKENS, chat_template=TINY_TOOL_CHAT_TEMPLATE)
    model, tok = load_causal_lm(path, "float32"), load_tokenizer(path)
    rng = random.Random(seed)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]

    def row(prompt: str) -> tuple[list[int], list[int]]:
        expr = prompt.rstrip("=")
        a, _, b = expr.partition("+")
        p, call = tok.encode(prompt, add_special_tokens=False), tok.encode(call_text(expr), add_special_tokens=False)
        env = tok.encode(f"<tool_response>{int(a) + int(b)}</tool_response>", add_special_tokens=False)
        answer = [rng.choice(digits) for _ in range(ANSWER_DIGITS)] + [EOS_ID]
        ids = p + call + [EOS_ID] + env + answer
        labels = [-100] * len(p) + call + [EOS_ID] + [-100] * len(env) + answer
        return ids, labels

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the other processes
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            rows = [row(rng.choice(prompts)) for _ in range(32)]  # every row has the same length
            ids, labels = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
