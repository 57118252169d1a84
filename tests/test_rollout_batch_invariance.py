"""The torch engine's batch-invariance contract: a seeded request's tokens do not depend on the
other requests of its call, whatever sampling modes they mix (the sampler picks one mode per
call: greedy, plain or cut; sampler.py).

What is shown where: the sampler alone, given a row's logits, on the CPU and the GPU; the whole
engine's tokens in fp32 on the CPU and on the GPU (CUDA graphs, Triton kernels on and off). In
bf16 on a GPU the batch changes the shapes of the forward's matmuls and attention, so their
rounding, and a near tie can flip (issue 22 measured 9 of 64 requests); the batch_invariant
option fixes those shapes: bitwise equal tokens and log-probs, shown on the GPU in bf16.
"""

from itertools import combinations

import pytest
import torch

from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.sampling import SamplingParams
from roles.rollout.torch_engine.sampler import SamplingRows, sample, sampling_mode

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# one request per kind of row; together they make every mix of the three call modes
KINDS = {
    "greedy": {"temperature": 0.0},
    "plain": {"temperature": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 5},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "top_k_top_p": {"temperature": 1.3, "top_k": 20, "top_p": 0.8},
}
PROMPTS = {"greedy": [5, 14, 6, 17], "plain": [9], "top_k": [7, 8, 9, 10, 11, 12, 13], "top_p": [20, 21],
           "top_k_top_p": [9]}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _request(kind: str) -> dict:
    index = list(KINDS).index(kind)
    return {"id": index, "prompt_ids": PROMPTS[kind],
            "sampling": {"max_new_tokens": 12, "ignore_eos": True, "seed": 1000 + index, **KINDS[kind]}}


@pytest.mark.parametrize("device", DEVICES)
def test_the_sampler_draws_a_row_alike_alone_and_among_rows_of_every_mode(device):
    vocab, n = 30001, 20  # many 128-token blocks, the last one partial
    g = torch.Generator(device).manual_seed(0)
    logits = 3 * torch.randn(n, vocab, device=device, generator=g)
    params = [SamplingParams(**KINDS[k]) for k in KINDS] * (n // len(KINDS))
    seeds, positions = list(range(n)), torch.arange(n, device=device) + 100
    batch = SamplingRows.build(params, seeds, vocab, device)
    tokens, logprobs = sample(logits, batch, positions, mode=sampling_mode(params))
    for i, p in enumerate(params):
        row = SamplingRows.build([p], seeds[i:i + 1], vocab, device)
        token, logprob = sample(logits[i:i + 1], row, positions[i:i + 1], mode=sampling_mode([p]))
        assert int(token) == int(tokens[i]), (i, p)
        if device == "cpu":
            assert float(logprob) == float(logprobs[i]), (i, p)  # bitwise
        else:  # CUDA's reductions over the vocabulary differ by the rows of the call: an ulp or two (H200)
            torch.testing.assert_close(logprob, logprobs[i:i + 1], rtol=1e-6, atol=0)


def _check_every_mix(engine: RolloutEngine, atol: float) -> None:
    alone = {kind: engine.generate([_request(kind)])[0] for kind in KINDS}
    mixes = [list(KINDS)] + [list(pair) for pair in combinations(KINDS, 2)]
    modes = {sampling_mode([SamplingParams(**KINDS[k]) for k in mix]) for mix in mixes}
    assert modes == {"plain", "cut"}  # the mixes put plain and greedy rows in calls of other modes
    for mix in mixes:
        for kind, got in zip(mix, engine.generate([_request(kind) for kind in mix])):
            assert got["token_ids"] == alone[kind]["token_ids"], (kind, mix)
            torch.testing.assert_close(got["logprobs"], alone[kind]["logprobs"], atol=atol, rtol=0)


def test_a_seeded_request_draws_the_same_tokens_in_every_mix_of_sampling_modes(ckpt):
    _check_every_mix(RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=0)), atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("triton", [True, False])
def test_on_the_gpu_in_fp32_too_with_graphs(ckpt, triton):
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=0, options={"triton": triton}))
    assert engine._backend.graphs.enabled
    _check_every_mix(engine, atol=1e-4)  # the batch changes matmul shapes: last-bit differences


def _mixed_requests(n: int) -> list[dict]:
    """n seeded requests of every kind, with prompts and lengths that differ."""
    kinds = list(KINDS)
    return [{"id": i, "prompt_ids": [3 + i % 11, 9, 4 + i % 7, 21, 8][:1 + i % 5],
             "sampling": {"max_new_tokens": 5 + 4 * (i % 4), "ignore_eos": True, "seed": 50 + i,
                          **KINDS[kinds[i % len(kinds)]]}} for i in range(n)]


def test_the_batch_invariant_option_prefills_one_prompt_at_a_time_and_decodes_every_slot(ckpt):
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=4,
                                        options={"batch_invariant": True}))
    requests = _mixed_requests(9)
    out = engine.generate(requests)
    stats = engine._backend.scheduler.last_stats
    assert stats["num_slots"] == 4 and stats["num_prefills"] == len(requests)
    assert stats["slot_steps"] == 4 * stats["decode_steps"]  # every slot, busy or not
    for request, got in zip(requests, out):
        assert got["token_ids"] == engine.generate([request])[0]["token_ids"]


@pytest.mark.gpu
def test_the_batch_invariant_option_makes_bf16_tokens_and_logprobs_bitwise_independent_of_the_batch(ckpt):
    # The forward's rounding is what the batch changes in bf16 (issue 22: 9 of 64 requests drew
    # other tokens); log-probs are compared bitwise, which any change of rounding shows.
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16", max_batch_size=8,
                                        options={"batch_invariant": True}))
    assert engine._backend.scheduler.fused and engine._backend.graphs.enabled
    requests = _mixed_requests(20)  # through 8 slots: refills while decoding
    together = engine.generate(requests)
    assert engine._backend.scheduler.last_stats["admitted_while_decoding"] > 0
    for request, got in zip(requests, together):
        alone = engine.generate([request])[0]
        assert (got["token_ids"], got["logprobs"]) == (alone["token_ids"], alone["logprobs"]), request["id"]
