"""Tiny verifiable tasks generated on the spot, for CPU runs and tests (no dataset hub).

Each task writes a jsonl file in the ``PromptDataset`` format (``{"prompt", "label"}``
per line) and names the reward rule that grades it. ``TASKS`` is keyed by the name in
``generated:NAME`` dataset strings.

The arithmetic task, e.g. ``{"prompt": "3+4=", "label": "7"}``: the model should answer
the label and then EOS. Its text uses only ``ARITHMETIC_CHARSET`` — the digits, ``+``,
``-``, ``*`` and ``=`` (a label is negative only with ``-``) — so a character-level
tokenizer of those characters plus its specials (BOS/EOS/pad) covers every prompt and
every correct answer.
"""

import functools
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ARITHMETIC_OPS = ("+", "-", "*")
ARITHMETIC_CHARSET = "0123456789+-*="
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def is_held_out(a: int, b: int, max_operand: int) -> bool:
    """Whether ``a <op> b`` is a held-out problem: ``b = a + 2`` modulo ``max_operand + 1``, one
    per row and per column of the operand table, so training sees every operand (and the
    swapped problem ``b <op> a``) but never these. None is held out when ``max_operand < 2``."""
    return max_operand >= 2 and (b - a) % (max_operand + 1) == 2


def write_arithmetic_task(
    path: str | Path, *, num_prompts: int, seed: int, max_operand: int = 9, ops: tuple[str, ...] = ("+",),
    exclude_held_out: bool = False,
) -> str:
    """Write ``num_prompts`` lines ``{"prompt": "A<op>B=", "label": "<result>"}``; return the path.

    Operands are drawn uniformly from ``0..max_operand`` and operators from ``ops``, all
    from ``random.Random(seed)``: the same arguments write the same file. Prompts may
    repeat when ``num_prompts`` exceeds the number of distinct ones. ``exclude_held_out``
    redraws the operand pairs ``is_held_out`` names (the eval set's).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if max_operand < 0:
        raise ValueError(f"max_operand={max_operand} must be >= 0")
    if not ops or any(op not in ARITHMETIC_OPS for op in ops):
        raise ValueError(f"ops={ops!r} must be a non-empty tuple drawn from {ARITHMETIC_OPS}")
    rng = random.Random(seed)
    lines = []
    for _ in range(num_prompts):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        while exclude_held_out and is_held_out(a, b, max_operand):
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice(ops)
        lines.append(json.dumps({"prompt": f"{a}{op}{b}=", "label": str(_APPLY[op](a, b))}))
    return _write_lines(path, lines)


def write_arithmetic_table(path: str | Path, *, held_out: bool, max_operand: int = 9,
                           ops: tuple[str, ...] = ("+",)) -> str:
    """Write every problem of the operand table that is (``held_out=True``: an eval set no
    training file of ``write_arithmetic_task(..., exclude_held_out=True)`` holds a line of) or
    is not (the problems training sees) held out (``is_held_out``), once each, in table order."""
    lines = [json.dumps({"prompt": f"{a}{op}{b}=", "label": str(_APPLY[op](a, b))})
             for a in range(max_operand + 1) for b in range(max_operand + 1) for op in ops
             if is_held_out(a, b, max_operand) == held_out]
    if not lines:
        raise ValueError(f"max_operand={max_operand} holds no problem out; it must be >= 2")
    return _write_lines(path, lines)


def _write_lines(path: str | Path, lines: list[str]) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a reader (another process of the run) never sees half a file.
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return str(path)


@dataclass(kw_only=True, frozen=True)
class GeneratedTask:
    write: Callable[..., str]  # write(path, *, num_prompts, seed) -> path
    rm_type: str  # the rule in roles.reward.rules.REWARD_RULES that grades it
    charset: str  # every character of its prompts and correct responses


TASKS: dict[str, GeneratedTask] = {
    # operands 0..4: every answer is a single digit, the format the tiny model starts with
    # (ppo/generated.py), so what PPO must learn is the sums themselves (20 of the 25: the
    # other 5 are the held-out eval set, EVAL_TASKS["arithmetic_heldout"])
    "arithmetic": GeneratedTask(write=functools.partial(write_arithmetic_task, max_operand=4, exclude_held_out=True),
                                rm_type="tiny_exact", charset=ARITHMETIC_CHARSET),
}
# `generated:NAME` eval sets (--eval-prompt-data): write(path) -> path. The held-out sums
# measure generalisation; the seen ones, beside them, what training taught.
EVAL_TASKS: dict[str, Callable[[str | Path], str]] = {
    "arithmetic_heldout": functools.partial(write_arithmetic_table, held_out=True, max_operand=4),
    "arithmetic_seen": functools.partial(write_arithmetic_table, held_out=False, max_operand=4),
}
