"""A reward model: an HF sequence classifier with one label (a Bradley-Terry reward model)
scoring (prompt, response) pairs, and the checks that refuse a checkpoint that is not one.

The text it scores is the conversation as the reward model was trained to read it: the
prompt's chat messages (the user's prompt, or the list a chat-format dataset gave) and the
response as the assistant's turn, through the reward model's own tokenizer and chat template
(as verl does when the RM's template differs from the policy's), never the policy's token ids.

Scoring sorts the sequences by length and cuts them into micro-batches of at most
`max_tokens` padded tokens (rows x longest), right-padded, so padding stays small; the score
of a row is the score head applied to the hidden state of its last real token, which is
what `AutoModelForSequenceClassification` pools (the test holds them equal), found from the
attention mask rather than from pad ids, so a pad id inside a response cannot move it.
On fake GPUs each micro-batch's activations are charged to the ledger while it runs
(`DeviceMemory.transient`, sized by roles.phase_memory), as a trainer's forward is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from roles.device import DeviceMemory
from roles.model_spec import ModelSpec
from roles.phase_memory import micro_batch_bytes
from runtime.units import format_bytes

SCORE_HEAD = "score.weight"  # the one-label head of every transformers *ForSequenceClassification


def checkpoint_problem(path: str) -> str | None:
    """Why `path` is not a reward model this scorer runs (no config, not a one-label sequence
    classifier, no trained score head in its weights, no chat template), or None. Reads the
    config and the weight files' headers only."""
    root = Path(path)
    fix = ("pass an HF sequence-classification checkpoint with one label "
           "(`python -m ppo.make_model --arch qwen3-4b-rm DIR` writes an untrained one)")
    if not (root / "config.json").is_file():
        return f"--reward-model-path {path}: not an HF checkpoint (no config.json); {fix}"
    config = json.loads((root / "config.json").read_text())
    archs = config.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        return (f"--reward-model-path {path}: a {', '.join(archs) or 'model without architectures'}, not a "
                f"sequence classifier, so it has no score head; {fix}")
    num_labels = len(config.get("id2label") or {0: None, 1: None})  # transformers' default is 2 labels
    if num_labels != 1:
        return f"--reward-model-path {path}: its score head has {num_labels} labels, a reward model has 1; {fix}"
    names = set()
    for file in root.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names.update(f.keys())
    if not any(n == SCORE_HEAD or n.endswith("." + SCORE_HEAD) for n in names):
        return (f"--reward-model-path {path}: no {SCORE_HEAD} in its safetensors weights (transformers would "
                f"start the head from random numbers); {fix}")
    try:
        ModelSpec.from_hf(config)
    except ValueError as e:
        return f"--reward-model-path {path}: {e}"
    if not AutoTokenizer.from_pretrained(path).chat_template:
        return (f"--reward-model-path {path}: its tokenizer has no chat template, so the conversation it "
                "was trained on cannot be rebuilt; add the template it was trained with to tokenizer_config.json")
    return None


def budget_problem(path: str, *, dtype: str, max_tokens: int, capacity: int) -> str | None:
    """Why the reward model cannot score on a device of `capacity` bytes (its weights in
    `dtype` and one micro-batch of `max_tokens` tokens's activations, roles.phase_memory), or
    None. The colocated roles' residuals come on top: the fake-GPU ledger checks those."""
    numel = 0
    for file in Path(path).glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            numel += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    width = getattr(torch, dtype).itemsize
    spec = ModelSpec.from_hf(json.loads((Path(path) / "config.json").read_text()))
    need = numel * width + micro_batch_bytes(spec, num_tokens=max_tokens, num_logit_tokens=0,
                                             width=width, training=False, with_logits=False)
    if need <= capacity:
        return None
    return (f"--reward-model-path {path}: its {dtype} weights and one micro-batch of "
            f"--reward-model-max-tokens-per-gpu {max_tokens} need {format_bytes(need)}, more than its GPU's "
            f"{format_bytes(capacity)}; lower --reward-model-max-tokens-per-gpu or give it a larger GPU")


def messages_of(sample: dict) -> list[dict]:
    """The conversation to score: the prompt's messages (`messages`, when a chat template
    formatted the prompt, else the prompt as the user's) and the response as the assistant's."""
    prompt = sample.get("messages") or [{"role": "user", "content": sample["prompt"]}]
    return [*prompt, {"role": "assistant", "content": sample["response"]}]


def micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices, longest first, cut so that rows x longest row <= max_tokens (one row at least)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class RewardModel:
    """A loaded reward model and its tokenizer; weights start on the CPU (tag "weights")."""

    def __init__(self, path: str, *, dtype: str, max_tokens: int, memory: DeviceMemory):
        self.memory = memory
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.spec = ModelSpec.from_hf(self.model.config)
        self.max_tokens = max_tokens
        self.context = self.model.config.max_position_embeddings
        self.onloaded = False

    def onload(self) -> None:
        if not self.onloaded:
            self.memory.move(self.model, "device", tag="weights")
            self.onloaded = True

    def offload(self) -> None:
        if self.onloaded:
            self.memory.move(self.model, "cpu", tag="weights")
            self.onloaded = False

    def encode(self, samples: list[dict]) -> list[list[int]]:
        """Token ids of each sample's conversation, cut to the model's context from the left
        (the end of the response, where the score is read, is kept)."""
        out = []
        for s in samples:
            ids = self.tokenizer.apply_chat_template(messages_of(s), tokenize=True, return_dict=False)
            out.append(list(ids)[-self.context:])
        return out

    @torch.no_grad()
    def score(self, samples: list[dict]) -> tuple[list[float], dict]:
        """One float per sample, in order; and {"num_tokens", "num_padded_tokens"} scored."""
        if not self.onloaded:
            raise RuntimeError("the reward model is offloaded: onload it (take its GPU's lease) before scoring")
        ids = self.encode(samples)
        scores = [0.0] * len(ids)
        padded = 0
        base = getattr(self.model, self.model.base_model_prefix)
        for rows in micro_batches([len(x) for x in ids], self.max_tokens):
            width = len(ids[rows[0]])
            input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                input_ids[r, :len(ids[i])] = torch.tensor(ids[i])
                mask[r, :len(ids[i])] = 1
            nbytes = micro_batch_bytes(self.spec, num_tokens=input_ids.numel(), num_logit_tokens=0,
                                       width=self.model.dtype.itemsize, training=False, with_logits=False)
            with self.memory.transient("activations", nbytes, phase="reward_model"):
                device = self.memory.device
                hidden = base(input_ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # [B, T, H]
                last = hidden[torch.arange(len(rows), device=device), mask.sum(1).to(device) - 1]  # [B, H]
                values = self.model.score(last)[:, 0].float().cpu()  # [B]
            for r, i in enumerate(rows):
                scores[i] = float(values[r])
            padded += input_ids.numel()
        return scores, {"num_tokens": sum(map(len, ids)), "num_padded_tokens": padded}
