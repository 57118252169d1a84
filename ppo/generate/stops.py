"""The token ids a rollout's (and an eval's) model turn stops on.

The tokenizer's eos, --rollout-stop-token-ids, and the ids of --rollout-stop's strings. miles
passes its --rollout-stop strings to sglang as `stop`; both engines here stop on token ids only
(roles/rollout/sampling.py), so each string must be one token of the tokenizer, as tool-call
tags are in the tokenizers that have them (Qwen2.5/Qwen3's `</tool_call>`, tiny_tools'). The stop
token stays in the response, as every stop token does: a turn cut at `</tool_call>` keeps the
whole call for the tool parser (sglang's function-calling docs ask for `no_stop_trim` for the
same reason) and trains the model to close it.
"""

from __future__ import annotations


def stop_token_ids(cfg, tokenizer) -> tuple[int, ...]:
    """ValueError (one line) naming a --rollout-stop string that is not exactly one token."""
    r = cfg.rollout
    ids = [tokenizer.eos_token_id, *(r.rollout_stop_token_ids or ())]
    for s in r.rollout_stop or ():
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1 or tokenizer.decode(encoded, skip_special_tokens=False) != s:
            raise ValueError(f"--rollout-stop {s!r}: the engines stop on token ids, and this tokenizer writes {s!r} "
                             f"as {len(encoded)} tokens {encoded}; give strings that are one token each (a tool "
                             "call's closing tag in most tokenizers), or their ids in --rollout-stop-token-ids")
        ids.append(encoded[0])
    return tuple(dict.fromkeys(ids))  # in order, each once
