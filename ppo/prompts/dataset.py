"""Prompt datasets: jsonl prompts with labels, served in seeded, resumable epochs.

The file format is the one miles/slime read (e.g. DAPO-Math-17k): one JSON object per
line, the prompt under ``input_key`` as a string or a chat message list
``[{"role": "user", "content": ...}]``, the label under ``label_key``, optional metadata
under ``metadata_key`` (a dict, or a JSON string of one). Blank lines are ignored.
"""

import copy
import hashlib
import json
import logging
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


class BadSample(ValueError):
    """One jsonl line that cannot become a sample; the message names the file and line."""


class PromptDataset:
    """All usable samples of one jsonl file, tokenized once at load time.

    Every problem with a line — malformed JSON, a missing key, an empty prompt, a prompt
    longer than ``max_prompt_len`` tokens, or one whose tokens plus ``response_len`` exceed
    the model's ``context_len`` (its max_position_embeddings) — raises
    ``ValueError("FILE:LINE: ...")``, or with ``skip_bad_samples`` drops the line and records
    it in ``skipped`` as ``(line, reason)``.

    ``tokenizer`` needs ``encode(text, add_special_tokens=False) -> list[int]`` and, for
    ``apply_chat_template``, an HF-style ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``; a string prompt is then sent as one user message.
    Without a tokenizer ``prompt_ids`` is None (for engines that tokenize themselves).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        input_key: str = "prompt",
        label_key: str | None = "label",
        metadata_key: str | None = None,
        tokenizer=None,
        apply_chat_template: bool = False,
        max_prompt_len: int | None = None,
        context_len: int | None = None,
        response_len: int = 0,
        skip_bad_samples: bool = False,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if apply_chat_template and tokenizer is None:
            raise ValueError("apply_chat_template=True needs a tokenizer (its chat template formats the prompt)")
        if max_prompt_len is not None and tokenizer is None:
            raise ValueError(f"max_prompt_len={max_prompt_len} needs a tokenizer to count prompt tokens")
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be >= 1 (tokens) or None")
        if context_len is not None and tokenizer is None:
            raise ValueError(f"context_len={context_len} needs a tokenizer to count prompt tokens")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"prompt dataset {str(self.path)!r} does not exist or is not a file")
        self._input_key = input_key
        self._label_key = label_key
        self._metadata_key = metadata_key
        self._tokenizer = tokenizer
        self._apply_chat_template = apply_chat_template
        self._max_prompt_len = max_prompt_len
        self._context_len, self._response_len = context_len, response_len
        self._seed = seed
        self._shuffle = shuffle
        self.skipped: list[tuple[int, str]] = []
        self._samples = self._load(skip_bad_samples)
        if not self._samples:
            raise ValueError(f"{self.path}: no usable samples ({len(self.skipped)} lines skipped)")
        if self.skipped:
            line, reason = self.skipped[0]
            logger.warning(
                "%s: skipped %d bad samples; the first, line %d: %s", self.path, len(self.skipped), line, reason
            )
        self._fingerprint = _fingerprint(self._samples)
        self._epoch = 0
        self._position = 0
        self._order = self._order_of(0)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    @property
    def epoch(self) -> int:
        """Epochs completed so far (0 while the first pass is under way)."""
        return self._epoch

    def __len__(self) -> int:
        return len(self._samples)

    @property
    def longest_prompt(self) -> int | None:
        """Tokens of the longest prompt (what the memory plan sizes activations by); None
        without a tokenizer."""
        lengths = [len(s["prompt_ids"]) for s in self._samples if s["prompt_ids"] is not None]
        return max(lengths) if lengths else None

    def next_batch(self, n: int) -> list[dict]:
        """The next ``n`` samples ``{"prompt", "prompt_ids", "label", "metadata"}`` (and ``"messages"``, the
        chat before its template, with ``apply_chat_template``), crossing epochs as needed.

        Each epoch visits every sample once, in an order fixed by ``(seed, epoch)``.
        """
        if n < 1:
            raise ValueError(f"n={n} must be >= 1 (prompts per batch)")
        batch = []
        for _ in range(n):
            sample = self._samples[self._order[self._position]]
            # Copies: a caller that edits its batch must not change what a later epoch serves.
            prompt_ids = None if sample["prompt_ids"] is None else list(sample["prompt_ids"])
            batch.append({**sample, "prompt_ids": prompt_ids, "metadata": copy.deepcopy(sample["metadata"])})
            self._position += 1
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._order_of(self._epoch)
        return batch

    def state_dict(self) -> dict:
        """Where the iteration stands; ``load_state_dict`` on a dataset of the same data resumes it exactly."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_samples": len(self._samples),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        # A resume over other data, another seed or another order would silently change
        # which prompts come next: refuse it, naming what differs.
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_samples", "fingerprint"):
            if state[key] != mine[key]:
                raise ValueError(
                    f"cannot resume {self.path}: saved {key}={state[key]!r} but this dataset has {key}={mine[key]!r} "
                    "(the data file, seed or shuffle changed since the checkpoint)"
                )
        if not 0 <= state["position"] < len(self._samples) or state["epoch"] < 0:
            raise ValueError(
                f"cannot resume {self.path}: epoch={state['epoch']} position={state['position']} out of range"
            )
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._order_of(self._epoch)

    def _order_of(self, epoch: int) -> list[int]:
        if not self._shuffle:
            return list(range(len(self._samples)))
        return np.random.default_rng([self._seed, epoch]).permutation(len(self._samples)).tolist()

    def _load(self, skip_bad_samples: bool) -> list[dict]:
        samples = []
        with self.path.open("rb") as f:
            for line_number, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                try:
                    samples.append(self._parse(raw))
                except BadSample as e:
                    if not skip_bad_samples:
                        hint = "fix the line, or pass --skip-bad-samples (skip_bad_samples=True) to skip such lines"
                        raise BadSample(f"{self.path}:{line_number}: {e} ({hint})") from None
                    self.skipped.append((line_number, str(e)))
        return samples

    def _parse(self, raw: bytes) -> dict:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadSample(f"not UTF-8 text (byte {e.start})") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadSample(f"malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise BadSample(f"expected a JSON object, got {type(record).__name__}")
        if self._input_key not in record:
            raise BadSample(f"missing prompt key {self._input_key!r} (keys: {sorted(record)})")
        prompt, messages = self._prompt_text(record[self._input_key])
        prompt_ids = None
        if self._tokenizer is not None:
            prompt_ids = [int(t) for t in self._tokenizer.encode(prompt, add_special_tokens=False)]
            if self._max_prompt_len is not None and len(prompt_ids) > self._max_prompt_len:
                raise BadSample(f"prompt has {len(prompt_ids)} tokens, more than max_prompt_len={self._max_prompt_len}")
            if self._context_len is not None and len(prompt_ids) + self._response_len > self._context_len:
                raise BadSample(f"prompt has {len(prompt_ids)} tokens; with {self._response_len} response tokens "
                                f"that is {len(prompt_ids) + self._response_len}, more than the model's context "
                                f"of {self._context_len} (max_position_embeddings)")
        label, metadata = self._label(record), self._metadata(record)
        # a chat-formatted prompt keeps its messages: a reward model reads them with its own template
        return {"prompt": prompt, "prompt_ids": prompt_ids, "label": label, "metadata": metadata,
                **({"messages": messages} if messages else {})}

    def _prompt_text(self, prompt) -> tuple[str, list[dict] | None]:
        """The prompt's text, and its chat messages when the chat template formatted it."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise BadSample("empty prompt")
            if not self._apply_chat_template:
                return prompt, None
            prompt = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            _check_messages(prompt)
            if not self._apply_chat_template:
                raise BadSample("the prompt is a chat message list; set apply_chat_template=True to format it")
        else:
            raise BadSample(f"the prompt must be a string or a chat message list, got {type(prompt).__name__}")
        text = self._tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            kind = type(text).__name__
            raise TypeError(f"tokenizer.apply_chat_template(..., tokenize=False) returned {kind}, not str")
        return text, prompt

    def _label(self, record: dict) -> str | None:
        if self._label_key is None:
            return None
        if self._label_key not in record:
            raise BadSample(f"missing label key {self._label_key!r} (keys: {sorted(record)})")
        label = record[self._label_key]
        if isinstance(label, bool) or not isinstance(label, (str, int, float)):
            raise BadSample(f"the label must be a string or a number, got {label!r}")
        return str(label)

    def _metadata(self, record: dict) -> dict:
        if self._metadata_key is None or record.get(self._metadata_key) is None:
            return {}
        metadata = record[self._metadata_key]
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except json.JSONDecodeError:
                raise BadSample(f"metadata {self._metadata_key!r} is a string but not JSON") from None
        if not isinstance(metadata, dict):
            raise BadSample(f"metadata {self._metadata_key!r} must be an object, got {type(metadata).__name__}")
        return metadata


def _check_messages(messages: list) -> None:
    if not messages:
        raise BadSample("empty prompt (an empty message list)")
    for message in messages:
        is_message = isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))
        if not is_message:
            raise BadSample(f"each chat message needs string 'role' and 'content', got {message!r}")
    if not any(m["content"].strip() for m in messages):
        raise BadSample("empty prompt (every message is empty)")


def _fingerprint(samples: list[dict]) -> str:
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(json.dumps([sample["prompt"], sample["label"]]).encode())
    return digest.hexdigest()[:16]
