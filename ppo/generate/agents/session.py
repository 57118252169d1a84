"""One agent session's record of tokens: what the engine generated, never tokenized again.

Every chat request is rendered by the chat template to text. The session keeps its records (one
`Trajectory` each) with the text of their ids, decoded for comparison only. A request whose
rendered prompt starts with a record's text continues that record: the rest of the text (the new
messages and the next assistant header) is tokenized once and appended as an environment turn,
and the engine continues from the record's ids, on the engine that holds their K/V (the session
keeps one sample index, so one engine). A request that continues no record (the template rewrote
history: Qwen3 drops earlier thinking blocks once a new user query comes; the agent trimmed or
edited its messages) starts a new record from its whole rendered prompt: a split, counted in
`stats["agent_splits"]`, never a silent re-tokenization of what the model wrote.

With n > 1 each choice is its own record (the first continues the matched record, the others
fork it, holding the model turns they share as context), so the agent may continue from
whichever choice it keeps. Every record trains (ppo.generate.agents.agent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ppo.generate.custom import turn_seed
from ppo.generate.trajectory import ENV, MODEL, Trajectory, Turn

AGENT_STATS = ("agent_requests", "agent_completions", "agent_splits", "agent_errors", "agent_records")


class ContextFull(Exception):
    """No token fits the record's response budget or the model's context (HTTP 400
    context_length_exceeded, as OpenAI answers a prompt that does not fit)."""


@dataclass
class Record:
    trajectory: Trajectory
    text: str  # the trajectory's ids decoded, kept in step with them


@dataclass(frozen=True)
class Completion:
    """One choice: the ids the record gained (with their log-probs) and what the agent reads."""

    ids: list[int]
    log_probs: list[float]
    text: str  # the ids decoded, without the end-of-turn token the template writes back (`turn_end`)
    finish_reason: str  # "stop" or "length"
    num_prompt_tokens: int  # the context it continued


class Session:
    """`await complete(prompt_text, n, sampling, stop)`: n completions continuing the record the
    prompt extends. `engine(sample_index, ids, sampling) -> result` is the engine client's generate.

    `sampling_params` is the rollout's (temperature, top_p, top_k, seed, stop_token_ids, and
    max_new_tokens: the budget of each record's whole response, environment tokens included,
    as for a generate function); requests run one at a time per session, in arrival order."""

    def __init__(self, index: int, tokenizer, sampling_params: dict, max_context: int,
                 engine: Callable[[int, list[int], dict], Awaitable[dict]]):
        self.index, self.tok, self.sampling_params, self.max_context = index, tokenizer, sampling_params, max_context
        self._engine = engine
        self.records: list[Record] = []
        self.last: Record | None = None  # the record of the latest completion: the one the scorer grades
        self.stats: dict[str, float] = dict.fromkeys(AGENT_STATS, 0)
        self.weight_version: int | None = None
        self.num_aborts = 0
        self.lock = asyncio.Lock()
        self._num_engine_requests = 0
        eos = tokenizer.eos_token_id
        self._stop_ids = frozenset(sampling_params.get("stop_token_ids") or ()) | ({eos} if eos is not None else set())
        self._turn_end = turn_end(tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def continued(self, prompt_text: str) -> Record | None:
        """The longest record whose text the prompt starts with."""
        best = None
        for r in self.records:
            if prompt_text.startswith(r.text) and (best is None or len(r.text) > len(best.text)):
                best = r
        return best

    async def complete(self, prompt_text: str, n: int, max_tokens: int | None, stop: list[str]) -> list[Completion]:
        async with self.lock:
            self.stats["agent_requests"] += 1
            base = self.continued(prompt_text)
            if base is None:
                trajectory = Trajectory(self.tok.encode(prompt_text, add_special_tokens=False))
                env: list[int] = []
                if self.records:
                    self.stats["agent_splits"] += 1
            else:
                trajectory = base.trajectory
                env = self.tok.encode(prompt_text[len(base.text):], add_special_tokens=False)
            ids = trajectory.ids + env
            budget = min(self.sampling_params["max_new_tokens"] - len(trajectory.response_ids) - len(env),
                         self.max_context - len(ids), max_tokens or float("inf"))
            if budget <= 0:
                raise ContextFull(f"the conversation has {len(ids)} tokens ({len(trajectory.response_ids) + len(env)} "
                                  f"after the first prompt); no completion token fits the session's response budget "
                                  f"({self.sampling_params['max_new_tokens']}) or the model's context "
                                  f"({self.max_context})")
            results = await asyncio.gather(*(self._engine(self.index, ids, self._request(int(budget)))
                                             for _ in range(n)))
            completions, prior = [], list(trajectory.turns)
            for k, result in enumerate(results):
                completion = self._completion(result, stop, len(ids))
                if k == 0 and base is not None:  # choice 0 continues the record in place; the others fork it
                    record = base
                else:  # a fork: the turns it shares train once, in the record they came from (miles:
                    # miles/rollout/session/v2/postprocessor_hub/default_postprocess.py), so here they are context
                    record = Record(Trajectory(list(trajectory.prompt_ids), [_as_context(t) for t in prior]), "")
                    self.records.append(record)
                traj = record.trajectory
                if env:
                    traj.add_env_turn(env)
                traj.add_model_turn(completion.ids, completion.log_probs, completion.finish_reason,
                                    result["weight_version"])
                record.text = self.decode(traj.ids)
                self.last = record if k == 0 else self.last
                completions.append(completion)
            self.stats["agent_completions"] += n
            return completions

    def _request(self, budget: int) -> dict:
        p = self.sampling_params
        seed = p.get("seed")
        request = dict(p, max_new_tokens=budget,
                       seed=turn_seed(seed, self._num_engine_requests) if seed is not None else None)
        self._num_engine_requests += 1
        return request

    def _completion(self, result: dict, stop: list[str], num_prompt_tokens: int) -> Completion:
        ids, log_probs, finish = list(result["token_ids"]), list(result["logprobs"]), result["finish_reason"]
        version = result["weight_version"]
        self.weight_version = version if self.weight_version is None else min(self.weight_version, version)
        self.num_aborts += result.get("num_aborts", 0)
        # the stop token that ends the turn is the template's to write back after the message; any
        # other (a tool call's closing tag: --rollout-stop '</tool_call>') is part of what the model wrote
        ended = (finish == "stop" and ids and ids[-1] in self._stop_ids
                 and self._turn_end.startswith(self.decode(ids[-1:])))
        text = self.decode(ids[:-1] if ended else ids)
        cut = _first_stop(text, stop)
        if cut is not None:
            # the record keeps the tokens whose text lies before the stop string, so that the
            # agent's copy of the message renders back to exactly those tokens
            keep = max(j for j in range(len(ids) + 1) if len(self.decode(ids[:j])) <= cut)
            ids, log_probs, finish = ids[:keep], log_probs[:keep], "stop"
            text = self.decode(ids)
        return Completion(ids, log_probs, text, finish, num_prompt_tokens)

    def training_records(self) -> list[Record]:
        """Every record, the latest last: each trains, with the session's reward (ppo.generate.agents.agent)."""
        return [r for r in self.records if r is not self.last] + ([self.last] if self.last is not None else [])


def turn_end(tokenizer) -> str:
    """What the chat template writes right after an assistant message's content: Qwen3's
    "<|im_end|>\\n", Llama 3's "<|eot_id|>", tiny_tools' "<eos>"."""
    mark = "END-OF-CONTENT"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}],
                                         tokenize=False)
    return text[text.rindex(mark) + len(mark):]


def _as_context(turn: Turn) -> Turn:
    """A model turn another record trains, copied as context (loss mask 0) of a fork."""
    return Turn(ENV, turn.ids) if turn.source == MODEL else turn


def _first_stop(text: str, stop: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(found) if found else None
