"""Generate requests and their sampling semantics, shared by the rollout backends.

The `torch` backend implements them on the device in torch_engine/sampler.py.

Semantics follow sglang's SamplingParams so both backends answer the same request alike:

- `temperature` 0 (below 1e-6) is greedy; otherwise logits are divided by it.
- `top_k` -1 disables it; `top_p` 1.0 disables it. Both cut the temperature-scaled
  distribution, top-p by the cumulative probability *before* each token (the most likely
  token always survives), and the survivors are sampled in proportion to their probability.
- Returned log-probs are those of the sampled token under the temperature-scaled
  distribution BEFORE the top-k/top-p cut: log_softmax(logits / T)[token], T = 1 when
  greedy. That is what sglang's `return_logprob` reports (without
  SGLANG_RETURN_ORIGINAL_LOGPROB) and what the trainer recomputes as old log-probs from
  logits / T, so PPO's importance ratio starts at 1.
- A request finishes with "length" once it has `max_new_tokens` tokens (checked first),
  else with "stop" when the token is in `stop_token_ids` or is one of the model's eos
  ids. `ignore_eos=True` turns off BOTH kinds of token stop, as in sglang. The stop token
  is part of the response (PPO must learn to emit it).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass


GREEDY_EPS = 1e-6  # sglang's threshold: smaller temperatures mean greedy


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # None: the engine derives one (see RolloutEngine.generate)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_dict(cls, d: dict, *, where: str) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown sampling keys {unknown}; allowed: {sorted(known)}")
        params = cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids") or ())})
        params._validate(where)
        return params

    def _validate(self, where: str) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return ValueError(f"{where}: sampling {field}={getattr(self, field)!r} must be {allowed}")

        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature < float("inf"):
            raise bad("temperature", "a finite number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1] (1 disables it)")
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise bad("top_k", "-1 (disabled) or an int >= 1")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise bad("max_new_tokens", "an int >= 1")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of token ids >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", "an int or None")


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams


def parse_requests(requests: list[dict], *, vocab_size: int, max_positions: int) -> list[GenerateRequest]:
    """Validate wire requests {"id", "prompt_ids", "sampling"} into GenerateRequests."""
    if not isinstance(requests, list):
        raise ValueError(f"requests must be a list of dicts, got {type(requests).__name__}")
    parsed, seen = [], set()
    for i, req in enumerate(requests):
        where = f"request #{i} (id={req.get('id')!r})" if isinstance(req, dict) else f"request #{i}"
        if not isinstance(req, dict) or set(req) - {"id", "prompt_ids", "sampling"}:
            raise ValueError(f"{where}: must be a dict with keys 'id', 'prompt_ids', 'sampling'")
        rid, prompt = req.get("id"), list(req.get("prompt_ids") or [])
        if not _is_int(rid):
            raise ValueError(f"{where}: id must be an int")
        if rid in seen:
            raise ValueError(f"{where}: duplicate id {rid} in one generate call (results are matched by id)")
        seen.add(rid)
        if not prompt or not all(_is_int(t) and 0 <= t < vocab_size for t in prompt):
            raise ValueError(f"{where}: prompt_ids must be a non-empty list of ints in [0, {vocab_size})")
        sampling = SamplingParams.from_dict(req.get("sampling") or {}, where=where)
        if len(prompt) + sampling.max_new_tokens > max_positions:
            raise ValueError(
                f"{where}: prompt length {len(prompt)} + max_new_tokens {sampling.max_new_tokens} "
                f"exceeds the model's max_position_embeddings {max_positions}"
            )
        parsed.append(GenerateRequest(id=rid, prompt_ids=prompt, sampling=sampling))
    return parsed


def request_seed(engine_seed: int, engine_index: int, call_index: int, request: GenerateRequest) -> int:
    """The request's own seed, else one derived from where and when the engine serves it."""
    if request.sampling.seed is not None:
        return request.sampling.seed
    key = f"{engine_seed}/{engine_index}/{call_index}/{request.id}".encode()
    # 31 bits: a seed any consumer (torch, sglang's sampling_seed) takes as a plain int
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
