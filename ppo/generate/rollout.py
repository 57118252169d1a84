"""One rollout: sample n responses per prompt on the engines, score them as they finish.

Requests are spread evenly over the engines; each engine's results go to a reward scorer
(round robin) as soon as that engine returns, so scoring overlaps the slower engines'
generation. Every request carries its own seed, derived from (rollout seed, step, sample
index, and the dynamic-sampling round after the first): where the engine is batch invariant (the
torch engine in fp32; roles/rollout/torch_engine/sampler.py says what holds in bf16), a sample
does not depend on which engine produced it or what it was batched with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

from runtime import ActorDied, ActorHandle, RemoteError, wait_any


class RequestsFailed(RuntimeError):
    """An engine gave up on a request it aborted again and again (roles/rollout/aborts.py):
    the run stops; the message is the engine's one line."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n_samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    seed: int


def sample_seed(base: int, step: int, index: int, sampling_round: int = 0) -> int:
    key = f"{base}:{step}:{index}" + (f":r{sampling_round}" if sampling_round else "")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# A prompt whose metadata holds this key ([n] ints, one per sample) has the engine end sample k at
# that many tokens (ignore_eos, max_new_tokens), whatever it samples: benchmarks draw response
# lengths from a distribution this way, which an untrained model would not give (bench/partial_rollout.py).
FORCED_LENGTHS_KEY = "forced_response_lens"


def forced_length(prompt: dict, k: int) -> int | None:
    """The length sample k of `prompt` is told to end at, if its metadata says (FORCED_LENGTHS_KEY)."""
    lens = (prompt.get("metadata") or {}).get(FORCED_LENGTHS_KEY)
    return None if lens is None else int(lens[k])


def make_requests(prompts: list[dict], params: SamplingParams, step: int, sampling_round: int = 0) -> list[dict]:
    """n requests per prompt; request id = sample index = group * n + k."""
    n = params.n_samples_per_prompt
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids)}

    def sampling_of(p: dict, k: int, index: int) -> dict:
        forced = forced_length(p, k)
        length = {} if forced is None else {"max_new_tokens": min(forced, params.max_new_tokens), "ignore_eos": True}
        return dict(sampling, seed=sample_seed(params.seed, step, index, sampling_round), **length)

    return [{"id": g * n + k, "prompt_ids": list(p["prompt_ids"]), "sampling": sampling_of(p, k, g * n + k)}
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
                       params: SamplingParams, step: int, decode, eos_id: int,
                       recover: Callable[[ActorHandle, int], None], sampling_round: int = 0) -> list[dict]:
    """Samples in request order: prompt, response ids/text/log-probs, reward and status.

    An engine or scorer that dies mid-call is replaced (`recover(handle, dead_incarnation)`
    waits for the restarted incarnation and, for an engine, syncs it to the current policy), and its
    unfinished work is issued again. Requests carry their own seeds, so a re-issued request
    yields the sample it would have yielded the first time (where the engine is batch
    invariant; else one of the same distribution); results are keyed by request
    id, so nothing is counted twice. (Restarts are counted by the supervisor, at each death.)
    """
    requests = make_requests(prompts, params, step, sampling_round)
    chunks = split_evenly(requests, len(engines))
    n = params.n_samples_per_prompt

    def call(role: ActorHandle, method: str, arg):
        """Start a call; a role found dead (now or when its result is read) is replaced."""
        while True:
            try:
                return getattr(role, method).call(arg)
            except ActorDied as e:
                replace(role, e)

    def replace(role: ActorHandle, e: ActorDied) -> None:
        recover(role, e.incarnation)

    samples: dict[int, dict] = {}
    gen = {i: call(engines[i], "generate", chunk) for i, chunk in enumerate(chunks) if chunk}
    score: dict[int, tuple[list[dict], object]] = {}  # call k -> (its samples, future); k goes to scorer k % len
    next_scorer = 0
    while gen or score:
        wait_any([*gen.values(), *(f for _, f in score.values())])
        for i, fut in list(gen.items()):
            if not fut.done():
                continue
            del gen[i]
            try:
                results = fut.result()
            except ActorDied as e:
                replace(engines[i], e)
                gen[i] = call(engines[i], "generate", chunks[i])
                continue
            except RemoteError as e:
                if e.exc_type == "RequestsGaveUp":
                    raise RequestsFailed(e.remote_message) from None
                raise
            scored = []
            for r in results:
                s = _sample(r, r["id"] // n, prompts[r["id"] // n], decode, eos_id)
                samples[r["id"]] = s
                scored.append({k: s[k] for k in ("index", "group_index", "prompt", "response", "label",
                                                 "metadata")})
            if not scorers:  # a reward model alone: it scores the whole rollout after generation (ppo.generate.rewards)
                for x in scored:
                    samples[x["index"]].update(reward=0.0, reward_status="ok")
                continue
            # one scoring call per engine result; spread over the scorers round robin
            key = next_scorer
            next_scorer += 1
            score[key] = (scored, call(scorers[key % len(scorers)], "score", scored))
        for key, (scored, fut) in list(score.items()):
            if not fut.done():
                continue
            del score[key]
            try:
                results = fut.result()
            except ActorDied as e:
                scorer = scorers[key % len(scorers)]
                replace(scorer, e)
                score[key] = (scored, call(scorer, "score", scored))
                continue
            for res in results:
                samples[res["index"]].update(reward=res["reward"], reward_status=res["status"])
    return [samples[i] for i in range(len(requests))]


def _sample(r: dict, group: int, prompt: dict, decode, eos_id: int) -> dict:
    ids = r["token_ids"]
    text_ids = ids[:-1] if ids and ids[-1] == eos_id else ids
    return {"index": r["id"], "group_index": group,
            "prompt": prompt["prompt"], "prompt_ids": list(prompt["prompt_ids"]), "label": prompt.get("label"),
            "messages": prompt.get("messages"),  # the chat before its template, for a reward model
            "metadata": prompt.get("metadata") or {}, "response_ids": ids,
            "rollout_log_probs": r["logprobs"], "finish_reason": r["finish_reason"],
            "weight_version": r["weight_version"], "response": decode(text_ids),
            "num_aborts": r["num_aborts"]}
