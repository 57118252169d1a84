"""The tiny tool format: the calculator (roles.tools.calculator) as the tiny model calls it, in
Qwen's `<tool_call>{json}</tool_call>`.

The character-level tiny tokenizer (ppo.tiny_model) gets the markup as whole tokens, as real
tokenizers have them (Qwen3's <tool_call> is one token), plus the fixed JSON around the one
argument (the tool's name within it), so that a call fits the tiny model's 64 positions:

    347+285= <tool_call>{"name": "calculator", "arguments": {"expression": "347+285"}}</tool_call><eos>
             <tool_response>632</tool_response>632<eos>

The tool is roles.tools.calculator (TOOL_SPECS, execute_tool), run in process by the recipe
(--no-tool-sandbox: a sandbox per call costs ~0.2 s, and a rollout makes 1024 calls).
TINY_TOOL_CHAT_TEMPLATE renders that conversation (user text as is; the assistant's text and
calls, then <eos>; a tool's answer in <tool_response> tags; no generation prompt), so the tool
loop's tool turns come from the model's own template like any other model's.
"""

from __future__ import annotations

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               '{"name": "calculator", "arguments": {"expression": "', '"}}')
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


def call_text(expr: str) -> str:
    """What the model writes to call the calculator on `expr` (the template's rendering)."""
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


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

    from ppo.tiny_model import EOS_ID, build_tiny_checkpoint, load_causal_lm, load_tokenizer

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
