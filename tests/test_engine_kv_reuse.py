"""KV reuse across turns in the built-in engine (torch_engine/prefixes.py): a trajectory's next turn
prefills only its new tokens, and samples what a cold engine samples from the whole context."""

import pytest
import torch

from roles.rollout import EngineConfig, RolloutEngine
from roles.weight_sync import pack_buckets

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 14, 6, 17], [9, 8], [7, 8, 9, 10, 11, 12, 13], [20, 21], [30, 31, 32]]
ENV = [40, 41, 42]
STOPS = list(range(10, 16))  # frequent stops: rows finish mid-sync and decode garbage after


def engine(ckpt, sync_every):
    return RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=0, max_batch_size=8,
                                      options={"sync_every": sync_every}))


def requests(contexts, seed0, first_id=0):
    # the budget of the whole response (as ppo.generate does): prompt + max_new_tokens stays the same
    return [{"id": first_id + i, "prompt_ids": c,
             "sampling": {"max_new_tokens": 40 - len(c), "seed": seed0 + i, "stop_token_ids": STOPS}}
            for i, c in enumerate(contexts)]


@pytest.mark.parametrize("sync_every", [1, 4])
def test_turns_reuse_their_kv_and_sample_what_a_cold_engine_samples(ckpt, sync_every):
    warm, cold = engine(ckpt, sync_every), engine(ckpt, sync_every)
    contexts = [list(p) for p in PROMPTS]
    first = warm.generate(requests(contexts, 100))
    contexts = [c + r["token_ids"] + ENV for c, r in zip(contexts, first)]
    # turn 2: only the first three trajectories go on; the others' slots sit idle (decoding garbage)
    # while these run, and must still hold their prefixes for turn 3
    order = [[0, 1, 2], [3, 4]]
    for turn, live in enumerate(order):
        reqs = requests([contexts[i] for i in live], 200 + 10 * turn)
        got = warm.generate(reqs)
        stats = warm._backend.scheduler.last_stats
        reused = sum(len(contexts[i]) - len(ENV) - 1 for i in live)  # all but the env tokens and the last sample
        assert stats["reused_tokens"] == reused, stats
        assert stats["prefill_tokens"] == sum(len(contexts[i]) for i in live) - reused
        cold._backend.scheduler.forget_prefixes()
        want = cold.generate(reqs)
        assert cold._backend.scheduler.last_stats["reused_tokens"] == 0
        for g, w in zip(got, want):
            assert g["token_ids"] == w["token_ids"]
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)


def test_no_reuse_for_single_turn_samples_nor_after_new_weights(ckpt):
    e = engine(ckpt, 1)
    same_prompt = requests([PROMPTS[0]] * 4, 1)
    e.generate(same_prompt)
    e.generate(requests([PROMPTS[0]] * 4, 9))  # n samples of one prompt share it, but no turn continues
    assert e._backend.scheduler.last_stats["reused_tokens"] == 0
    out = e.generate(requests([PROMPTS[1]], 3))[0]
    norm = next(pack_buckets([("model.norm.weight", torch.ones(64))], 1 << 20))
    e.update_weights(norm)  # any weight update forgets the kept K/V
    e.set_weight_version(1)
    e.generate(requests([PROMPTS[1] + out["token_ids"] + ENV], 4))
    assert e._backend.scheduler.last_stats["reused_tokens"] == 0


def test_unmatched_requests_keep_the_decode_batch_narrow(ckpt):
    # Slots 0-2 still hold the first call's prefixes when the second call (no continuation) comes:
    # taking the empty slots 3-5 would decode a batch of 8 rows (a new graph on the GPU) where 4 serve.
    e = engine(ckpt, 1)
    widths = []
    for seed in (1, 2):
        e.generate(requests(PROMPTS[:3], seed))
        stats = e._backend.scheduler.last_stats
        widths.append(stats["slot_steps"] / stats["decode_steps"])  # rows decoded per step, on average
    assert max(widths) <= 4, widths  # 3 requests: the graph batch of 4


def test_a_continuation_keeps_its_slot_when_a_first_turn_comes_in_the_same_admission(ckpt):
    # slots 0-1 keep turn 1 of two trajectories; turn 2 of the one recorded first comes with a new
    # first turn (shorter, so packed first), which would evict the oldest record: its slot
    e = engine(ckpt, 1)
    contexts = [list(p) for p in PROMPTS[:2]]
    first = e.generate(requests(contexts, 100))
    table = e._backend.scheduler.prefixes
    oldest = min(table._age, key=table._age.get)
    i = next(i for i, c in enumerate(contexts) if table._held[oldest][0][:len(c)] == c)
    second = contexts[i] + first[i]["token_ids"] + ENV
    e.generate(requests([[20, 21], second], 300))
    assert e._backend.scheduler.last_stats["reused_tokens"] == len(second) - len(ENV) - 1
