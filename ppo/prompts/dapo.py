"""Math prompts in the DAPO-Math-17k format, generated locally (no dataset hub).

A line is what miles reads from `dapo-math-17k.jsonl` with `--input-key prompt
--label-key label --apply-chat-template`:

    {"prompt": [{"role": "user", "content": DAPO_TEMPLATE with the problem}], "label": "42"}

The problems are integer arithmetic, linear equations and counting questions with integer
answers (DAPO-Math-17k's labels are all integers), so the `dapo` and `deepscaler` reward
rules can grade them. They are for running the pipeline at full size, not for a benchmark.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

# DAPO-Math-17k's instruction around each problem, as the dataset ships it.
DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    "{problem}\n\nRemember to put your answer on its own line after \"Answer:\"")


def _arithmetic(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(10, 999), rng.randint(2, 99), rng.randint(1, 500)
    return f"Compute ${a} \\times {b} - {c}$.", a * b - c


def _linear(rng: random.Random) -> tuple[str, int]:
    x, a, b = rng.randint(-50, 50), rng.randint(2, 20), rng.randint(-100, 100)
    return f"Find the integer $x$ such that ${a}x + ({b}) = {a * x + b}$.", x


def _series(rng: random.Random) -> tuple[str, int]:
    n, d = rng.randint(5, 60), rng.randint(1, 9)
    return (f"What is the sum of the first {n} terms of the arithmetic sequence $1, {1 + d}, {1 + 2 * d}, \\ldots$?",
            n + d * n * (n - 1) // 2)


def _remainder(rng: random.Random) -> tuple[str, int]:
    base, exp, mod = rng.randint(2, 30), rng.randint(5, 60), rng.randint(3, 97)
    return f"What is the remainder when ${base}^{{{exp}}}$ is divided by ${mod}$?", pow(base, exp, mod)


KINDS = (_arithmetic, _linear, _series, _remainder)


def dapo_math_records(num_prompts: int, seed: int) -> list[dict]:
    """`num_prompts` records {"prompt": [user message], "label": str(int)}; the same
    arguments give the same records."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        problem, answer = rng.choice(KINDS)(rng)
        records.append({"prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=problem)}],
                        "label": str(answer)})
    return records


def write_dapo_math_prompts(path: str | os.PathLike, *, num_prompts: int, seed: int) -> str:
    """Write `dapo_math_records` as jsonl (written then renamed); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    partial.write_text("".join(json.dumps(r) + "\n" for r in dapo_math_records(num_prompts, seed)), encoding="utf-8")
    os.replace(partial, path)
    return str(path)
