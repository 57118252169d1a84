"""A scripted stand-in for the engine client's `generate(sample_index, prompt_ids, sampling)`
(ppo/generate/engines.py, EngineClient.generate), for the session server's tests.

It answers each request with the next scripted reply, as the engines answer (roles/rollout/
sampling.py): the reply's ids with the model's stop token appended (the stop token is part of
the response), cut at `max_new_tokens` with finish_reason "length" (checked first), one
log-prob per id, the weight version. A reply given as a list of ids is returned as is: the
model's own tokenization, which need not be what encoding its text gives."""

from __future__ import annotations


class ScriptedEngine:
    def __init__(self, tok, replies: list, weight_version: int = 0):
        self.tok, self.replies, self.weight_version = tok, list(replies), weight_version
        self.requests: list[tuple[int, list[int], dict]] = []  # (sample index, prompt ids, sampling)

    async def __call__(self, sample_index: int, prompt_ids: list[int], sampling: dict) -> dict:
        self.requests.append((sample_index, list(prompt_ids), dict(sampling)))
        reply = self.replies.pop(0)
        ids = list(reply) if isinstance(reply, list) else self.tok.encode(reply, add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        finish = "stop"
        if len(ids) > sampling["max_new_tokens"]:
            ids, finish = ids[:sampling["max_new_tokens"]], "length"
        return {"token_ids": ids, "logprobs": [-0.01 * (i + 1) for i in range(len(ids))], "finish_reason": finish,
                "weight_version": self.weight_version, "num_aborts": 0}


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 400, "stop_token_ids": [], "seed": 7}
