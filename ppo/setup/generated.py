"""Resolve `generated:NAME` models and datasets into files in the run directory.

CPU runs have no model or dataset hub, so `tiny_ppo` asks for a generated model and task:
the model is a random-init tiny Qwen3 written as an ordinary HF checkpoint (and then
loaded back by the same code that loads Qwen3-4B), the task a jsonl of prompt/label pairs.

A random model never emits "digit, EOS", so its reward would be zero forever and PPO would
have nothing to learn from. Like any RL post-training, we start from a model that knows
the answer *format* but not the answers: a few hundred teacher-forced steps on
"prompt -> a random digit, EOS". It answers right about one time in ten, by chance, and
PPO has to learn the arithmetic itself.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import torch

from ppo.config import PPOConfig
from ppo.config.schema import GENERATED_PREFIX
from ppo.prompts.tasks import EVAL_TASKS, TASKS

NUM_TASK_PROMPTS = 512
WARM_START_STEPS = 100  # enough for P(digit first) > 0.99 while each digit stays at ~0.1


def resolve_paths(cfg: PPOConfig, run_dir: Path,
                  begin: Callable[[str], None] = lambda stage: None) -> tuple[str, str]:
    """(hf_checkpoint dir, prompt jsonl) for the run, generating them when asked; `begin(stage)`
    is told of each generation step (ppo.observe.console times start-up)."""
    data = cfg.rollout.prompt_data
    task_prompts, answer_digits = None, 1
    if data.startswith(GENERATED_PREFIX):
        task = data.removeprefix(GENERATED_PREFIX)
        answer_digits = TASKS[task].answer_digits
        begin(f"writing the {task} task ({NUM_TASK_PROMPTS} prompts)")
        data = TASKS[task].write(run_dir / "data" / f"{task}.jsonl", num_prompts=NUM_TASK_PROMPTS,
                                 seed=cfg.rollout.rollout_seed)
        task_prompts = [json.loads(line)["prompt"] for line in Path(data).read_text().splitlines()]
    ckpt = cfg.checkpoint.hf_checkpoint
    if ckpt.startswith(GENERATED_PREFIX):
        ckpt = str(run_dir / "model" / ckpt.removeprefix(GENERATED_PREFIX))
        if not (Path(ckpt) / "config.json").exists():
            # the format is taught on the generated task's prompts; with a user's prompt file,
            # on prompts of the arithmetic task's shape (its lines are read by the loop, which
            # reports bad ones by file and line)
            prompts = task_prompts or [f"{a}+{b}=" for a in range(5) for b in range(5)]
            if ckpt.endswith("tiny-qwen3-tools"):  # the format taught is the calculator call's
                from ppo.generate import tiny_tools

                begin(f"building the tiny tool-calling model ({tiny_tools.WARM_START_STEPS} warm-start steps)")
                tiny_tools.build_tool_model(ckpt, prompts, seed=cfg.training.seed)
            else:
                begin(f"building the tiny model ({WARM_START_STEPS} warm-start steps)")
                _build_tiny_model(ckpt, prompts, answer_digits=answer_digits, seed=cfg.training.seed)
    return ckpt, data


def resolve_eval_paths(cfg: PPOConfig, run_dir: Path) -> list[tuple[str, str]]:
    """(name, jsonl path) of each --eval-prompt-data set, writing `generated:NAME` ones."""
    data = cfg.evaluation.eval_prompt_data or ()
    out = []
    for name, path in zip(data[0::2], data[1::2]):
        if path.startswith(GENERATED_PREFIX):
            task = path.removeprefix(GENERATED_PREFIX)
            path = EVAL_TASKS[task](run_dir / "data" / f"eval_{task}.jsonl")
        out.append((name, path))
    return out


def _build_tiny_model(path: str, prompts: list[str], *, answer_digits: int, seed: int) -> None:
    from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm, load_tokenizer

    build_tiny_checkpoint(path, seed=seed)
    model, tok = load_causal_lm(path, "float32"), load_tokenizer(path)
    _teach_answer_format(model, tok, prompts, answer_digits=answer_digits, seed=seed)
    model.save_pretrained(path, safe_serialization=True)


def _teach_answer_format(model, tok, prompts: list[str], *, answer_digits: int, seed: int,
                         batch: int = 32) -> None:
    """Teacher-force "prompt -> `answer_digits` random digits, EOS" (answers are random: format only)."""
    rng = random.Random(seed)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only fight the other processes
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(WARM_START_STEPS):
            rows = [tok.encode(rng.choice(prompts), add_special_tokens=False)
                    + [rng.choice(digits) for _ in range(answer_digits)] + [tok.eos_token_id]
                    for _ in range(batch)]
            ids = torch.tensor(rows)  # all prompts of a task have the same length: "a+b=", "ab+cd="
            labels = torch.full_like(ids, -100)
            labels[:, -answer_digits - 1:] = ids[:, -answer_digits - 1:]
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    torch.set_num_threads(threads)
    model.eval()
