"""One rollout: sample n responses per prompt on the engines, score them as they finish.

Requests are spread evenly over the engines; each engine's results go to a reward scorer
(round robin) as soon as that engine returns, so scoring overlaps the slower engines'
generation. Every request carries its own seed, derived from (rollout seed, step, sample
index): a sample does not depend on which engine produced it or what it was batched with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from runtime import ActorHandle, as_completed


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n_samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    seed: int


def sample_seed(base: int, step: int, index: int) -> int:
    digest = hashlib.blake2b(f"{base}:{step}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def make_requests(prompts: list[dict], params: SamplingParams, step: int) -> list[dict]:
    """n requests per prompt; request id = sample index = group * n + k."""
    n = params.n_samples_per_prompt
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}
    return [{"id": g * n + k, "prompt_ids": list(p["prompt_ids"]),
             "sampling": dict(sampling, seed=sample_seed(params.seed, step, g * n + k))}
            for g, p in enumerate(prompts) for k in range(n)]


def split_evenly(items: list, num_parts: int) -> list[list]:
    size, extra = divmod(len(items), num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def generate_and_score(engines: list[ActorHandle], scorers: list[ActorHandle], prompts: list[dict],
                       params: SamplingParams, step: int, decode, eos_id: int) -> list[dict]:
    """Samples in request order: prompt, response ids/text/log-probs, reward and status."""
    requests = make_requests(prompts, params, step)
    chunks = [c for c in split_evenly(requests, len(engines)) if c]
    gen_futs = [engines[i].generate.call(chunk) for i, chunk in enumerate(chunks)]
    samples: dict[int, dict] = {}
    score_futs = []
    n = params.n_samples_per_prompt
    for k, fut in enumerate(as_completed(gen_futs)):
        scored = []
        for r in fut.result():
            g = r["id"] // n
            prompt = prompts[g]
            ids = r["token_ids"]
            text_ids = ids[:-1] if ids and ids[-1] == eos_id else ids
            s = {"index": r["id"], "group_index": g, "prompt": prompt["prompt"],
                 "prompt_ids": list(prompt["prompt_ids"]), "label": prompt.get("label"),
                 "metadata": prompt.get("metadata") or {}, "response_ids": ids,
                 "rollout_log_probs": r["logprobs"], "finish_reason": r["finish_reason"],
                 "weight_version": r["weight_version"], "response": decode(text_ids)}
            samples[r["id"]] = s
            scored.append({key: s[key] for key in ("index", "group_index", "prompt", "response",
                                                   "label", "metadata")})
        score_futs.append(scorers[k % len(scorers)].score.call(scored))
    for fut in score_futs:
        for res in fut.result():
            samples[res["index"]].update(reward=res["reward"], reward_status=res["status"])
    return [samples[i] for i in range(len(requests))]
