"""Tiny verifiable tasks generated on the spot, for CPU runs and tests (no dataset hub).

Each task writes a jsonl file in the ``PromptDataset`` format (``{"prompt", "label"}``
per line) and names the reward rule that grades it. ``TASKS`` is keyed by the name in
``generated:NAME`` dataset strings.

The arithmetic task, e.g. ``{"prompt": "3+4=", "label": "7"}``: the model should answer
the label and then EOS. Its text uses only ``ARITHMETIC_CHARSET`` — the digits, ``+``,
``-``, ``*`` and ``=`` (a label is negative only with ``-``) — so a character-level
tokenizer of those characters plus its specials (BOS/EOS/pad) covers every prompt and
every correct answer.

The column-sum task, e.g. ``{"prompt": "23+41=", "label": "64"}``: two-digit sums without a
carry, so each answer digit is a one-digit sum of its column. It is graded digit by digit
(``tiny_digits``) and its held-out sums combine columns that training sees only in other sums.
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
        lines.append(_problem(a, op, b))
    return _write_lines(path, lines)


def write_arithmetic_table(path: str | Path, *, held_out: bool, max_operand: int = 9,
                           ops: tuple[str, ...] = ("+",)) -> str:
    """Write every problem of the operand table that is (``held_out=True``: an eval set no
    training file of ``write_arithmetic_task(..., exclude_held_out=True)`` holds a line of) or
    is not (the problems training sees) held out (``is_held_out``), once each, in table order."""
    lines = [_problem(a, op, b) for a in range(max_operand + 1) for b in range(max_operand + 1) for op in ops
             if is_held_out(a, b, max_operand) == held_out]
    if not lines:
        raise ValueError(f"max_operand={max_operand} holds no problem out; it must be >= 2")
    return _write_lines(path, lines)


def is_held_out_column_sum(a: int, b: int, max_tens: int = 4, max_units: int = 4) -> bool:
    """Whether the two-digit sum ``a+b`` is held out: each of its columns is a held-out pair
    of ``is_held_out`` (tens digits 1..max_tens as 0..max_tens-1, units 0..max_units).
    Training sees every column pair, held-out ones included, but never these combinations
    of them."""
    return is_held_out(a // 10 - 1, b // 10 - 1, max_tens - 1) and is_held_out(a % 10, b % 10, max_units)


def column_sums(max_tens: int = 4, max_units: int = 4) -> list[tuple[int, int]]:
    """Every two-digit sum without a carry whose operands have tens digits 1..max_tens and
    units 0..max_units (both at most 4), in table order: 400 sums with the defaults, 144 with
    tens 1..3 and units 0..3; every answer two digits."""
    if not (3 <= max_tens <= 4 and 2 <= max_units <= 4):
        raise ValueError(f"max_tens={max_tens} must be 3..4 and max_units={max_units} 2..4 "
                         "(no carry, and a held-out pair in each column)")
    operands = [10 * t + u for t in range(1, max_tens + 1) for u in range(max_units + 1)]
    return [(a, b) for a in operands for b in operands]


def write_column_sum_task(path: str | Path, *, num_prompts: int, seed: int, max_tens: int = 4,
                          max_units: int = 4) -> str:
    """``num_prompts`` lines ``{"prompt": "23+41=", "label": "64"}`` drawn with
    ``random.Random(seed)`` from the sums of ``column_sums`` that are not held out (380 with
    the defaults, 132 with tens 1..3 and units 0..3): an answer uniformly, then one of its sums."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = random.Random(seed)
    by_answer: dict[int, list[tuple[int, int]]] = {}
    for a, b in column_sums(max_tens, max_units):
        if not is_held_out_column_sum(a, b, max_tens, max_units):
            by_answer.setdefault(a + b, []).append((a, b))
    # Every answer is as likely, so no constant guess beats chance: drawn with the table's own
    # frequencies, PPO settles on "54" for every prompt (the mode of each column) and stalls.
    answers = sorted(by_answer)
    return _write_sums(path, [rng.choice(by_answer[rng.choice(answers)]) for _ in range(num_prompts)])


def write_column_sum_table(path: str | Path, *, held_out: bool, max_tens: int = 4, max_units: int = 4) -> str:
    """The held-out column sums (``held_out=True``; 20 with the defaults, 12 with tens 1..3 and
    units 0..3), or their swapped twins, which training sees (a twin's columns are pairs
    ``b = a - 2``; in one of them, modulo 3 or 5, that is not a held-out pair)."""
    held = [(a, b) for a, b in column_sums(max_tens, max_units)
            if is_held_out_column_sum(a, b, max_tens, max_units)]
    return _write_sums(path, held if held_out else [(b, a) for a, b in held])


def _write_sums(path: str | Path, pairs: list[tuple[int, int]]) -> str:
    return _write_lines(path, [_problem(a, "+", b) for a, b in pairs])


def _problem(a: int, op: str, b: int) -> str:
    """One task line: ``{"prompt": "A<op>B=", "label": "<result>"}``."""
    return json.dumps({"prompt": f"{a}{op}{b}=", "label": str(_APPLY[op](a, b))})


def _write_lines(path: str | Path, lines: list[str]) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a reader (another process of the run) never sees half a file.
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    partial.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return str(path)


# tiny_tools' task (ppo.generate.tiny_tools): three-digit sums with carries, which the tiny model
# cannot learn in 40 rollouts without its calculator
def write_tool_sum_task(path, *, num_prompts: int, seed: int) -> str:
    """``num_prompts`` lines ``{"prompt": "347+285=", "label": "632"}``, operands 100..499 drawn with
    ``random.Random(seed)`` (so every answer has three digits)."""
    import random

    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = random.Random(seed)
    lines = []
    for _ in range(num_prompts):
        a, b = rng.randint(100, 499), rng.randint(100, 499)
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}))
    return _write_lines(path, lines)


@dataclass(kw_only=True, frozen=True)
class GeneratedTask:
    write: Callable[..., str]  # write(path, *, num_prompts, seed) -> path
    rm_type: str  # the rule in roles.reward.rules.REWARD_RULES that grades it
    charset: str  # every character of its prompts and correct responses
    answer_digits: int  # the length of every answer, which the tiny model's warm start teaches


TASKS: dict[str, GeneratedTask] = {
    # operands 0..4: every answer is a single digit, the format the tiny model starts with
    # (ppo/setup/generated.py), so what PPO must learn is the sums themselves (20 of the 25: the
    # other 5 are the held-out eval set, EVAL_TASKS["arithmetic_heldout"])
    "arithmetic": GeneratedTask(write=functools.partial(write_arithmetic_task, max_operand=4, exclude_held_out=True),
                                rm_type="tiny_exact", charset=ARITHMETIC_CHARSET, answer_digits=1),
    # two-digit sums without carries, each answer digit a one-digit sum: the held-out ones share
    # every column with trained ones (docs/evaluation.md: what RL generalises on this task)
    "column_sums": GeneratedTask(write=write_column_sum_task, rm_type="tiny_digits", charset=ARITHMETIC_CHARSET,
                                 answer_digits=2),
    # tiny_ppo's task: the same with tens 1..3 and units 0..3 (132 sums, 12 held out), small
    # enough that the reward rises by 0.25 in 40 rollouts and the held-out sums follow the
    # trained ones (docs/evaluation.md)
    "column_sums_small": GeneratedTask(write=functools.partial(write_column_sum_task, max_tens=3, max_units=3),
                                       rm_type="tiny_digits", charset=ARITHMETIC_CHARSET, answer_digits=2),
    # tiny_tools' task: three-digit sums with carries, out of the tiny model's reach without its
    # calculator (ppo.generate.tiny_tools; graded by its answer_reward, digit by digit)
    "tool_sums": GeneratedTask(write=write_tool_sum_task, rm_type="tiny_digits", charset=ARITHMETIC_CHARSET, answer_digits=3),
}
# `generated:NAME` eval sets (--eval-prompt-data): write(path) -> path. The held-out sums
# measure generalisation; the seen ones, beside them, what training taught.
EVAL_TASKS: dict[str, Callable[[str | Path], str]] = {
    "arithmetic_heldout": functools.partial(write_arithmetic_table, held_out=True, max_operand=4),
    "arithmetic_seen": functools.partial(write_arithmetic_table, held_out=False, max_operand=4),
    "column_sums_heldout": functools.partial(write_column_sum_table, held_out=True),
    "column_sums_seen": functools.partial(write_column_sum_table, held_out=False),
    "column_sums_small_heldout": functools.partial(write_column_sum_table, held_out=True, max_tens=3, max_units=3),
    "column_sums_small_seen": functools.partial(write_column_sum_table, held_out=False, max_tens=3, max_units=3),
    "tool_sums_eval": lambda path: write_tool_sum_task(path, num_prompts=64, seed=7),  # 64 sums of tiny_tools' kind
}
