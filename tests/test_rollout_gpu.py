"""Real-GPU paths of the built-in torch rollout engine and DeviceMemory; skipped without CUDA.

Run on a GPU machine with `bash .ci/gpu -k rollout_gpu` (every test marked `gpu`). The
engine runs as it does in production there: CUDA graphs for decode, compiled elementwise ops.
"""

import gc

import pytest
import torch

from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm
from roles.rollout import RolloutEngine
from roles.weight_sync import checksum_named_tensors, push_weights

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 14, 6, 17], [9], [7, 8, 9, 10, 11, 12, 13]]


def _reqs(prompts=PROMPTS, first_id=0, **sampling):
    return [{"id": first_id + i, "prompt_ids": p,
             "sampling": {"max_new_tokens": 12, "ignore_eos": True, "seed": first_id + i, **sampling}}
            for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_checkpoint(str(root / "a"), seed=0), build_tiny_checkpoint(str(root / "b"), seed=1)


def _teacher_forced(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device="cuda")).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / (temperature or 1.0), -1)
    return lp.gather(1, torch.tensor(response, device="cuda")[:, None])[:, 0].cpu()


def _greedy(model, prompt, n):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_fp32_greedy_and_logprobs_equal_hf_with_graphs(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="float32")
    backend = eng._backend
    assert eng._memory.kind == "cuda" and all(t.is_cuda for t in backend.weights.storages.values())
    model = load_causal_lm(ckpts[0], "float32").cuda()
    out = eng.generate(_reqs(temperature=0))
    assert backend.graphs.enabled and backend.graphs.num_captures > 0  # decode really ran graphed
    assert [r["token_ids"] for r in out] == [_greedy(model, p, 12) for p in PROMPTS]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0}):
        out = eng.generate(_reqs(**sampling))
        assert out == eng.generate(_reqs(**sampling))  # seeded: reproducible on the GPU too
        for prompt, r in zip(PROMPTS, out):
            expected = _teacher_forced(model, prompt, r["token_ids"], sampling["temperature"])
            torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=1e-4, rtol=0)


def test_fp32_seeded_samples_do_not_depend_on_the_batch(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="float32", max_batch_size=4)
    alone = [eng.generate(_reqs([p], first_id=i, temperature=1.0))[0] for i, p in enumerate(PROMPTS)]
    crowd = eng.generate(_reqs(PROMPTS * 4, temperature=1.0))  # 12 requests through 4 slots: refills
    assert eng._backend.scheduler.last_stats["admitted_while_decoding"] == 8
    for i, a in enumerate(alone):
        assert crowd[i]["token_ids"] == a["token_ids"]


def test_bf16_logprobs_match_hf_within_bf16_tolerance(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="bfloat16")
    model = load_causal_lm(ckpts[0], "bfloat16").cuda()
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20}):
        out = eng.generate(_reqs(**sampling))
        for prompt, r in zip(PROMPTS, out):
            expected = _teacher_forced(model, prompt, r["token_ids"], sampling["temperature"])
            torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=5e-2, rtol=0)


def test_graph_replay_after_update_weights_uses_the_new_weights(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="float32")
    reqs = _reqs(temperature=0)
    old = eng.generate(reqs)
    captures = eng._backend.graphs.num_captures
    source = load_causal_lm(ckpts[1], "float32").cuda().state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=64 * 1024)  # GPU buckets, in place
    eng.set_weight_version(3)
    new = eng.generate(reqs)
    assert eng._backend.graphs.num_captures == captures  # the same graphs replayed
    want = RolloutEngine(ckpts[1], dtype="float32").generate(reqs)
    assert [r["token_ids"] for r in new] == [r["token_ids"] for r in want] != [r["token_ids"] for r in old]
    assert {r["weight_version"] for r in new} == {3}


def test_release_frees_weights_cache_and_graphs_and_resume_restores(ckpts):
    gc.collect()  # engines of earlier tests (reference cycles) must not count as ours
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    eng = RolloutEngine(ckpts[0], dtype="bfloat16", kv_cache_bytes=64 << 20)
    before = eng.generate(_reqs(temperature=0))
    backend = eng._backend
    assert backend.memory.ledger().get("cuda_graph", 0) >= 0 and backend.graphs._graphs
    on_gpu = eng.memory_report()["bytes_in_use"]
    report = eng.release(["weights", "kv_cache"])  # what ppo/loop.py releases; graphs ride along
    assert report["state"] == "released" and eng._released == {"weights", "kv_cache", "cuda_graph"}
    assert on_gpu - report["bytes_in_use"] >= backend.weights_bytes + (64 << 20)
    assert report["bytes_in_use"] - base < (1 << 20) and not backend.graphs._graphs
    assert all(t.device.type == "cpu" and t.is_pinned() for t in backend.weights.storages.values())
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(_reqs())
    assert eng.resume(["weights", "kv_cache"])["state"] == "ready"
    assert all(t.is_cuda for t in backend.weights.storages.values())
    assert eng.generate(_reqs(temperature=0)) == before
    assert backend.graphs._graphs  # captured again at first use


def test_update_weights_from_cpu_buckets_while_the_cache_is_released(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="bfloat16")
    eng.release(["weights", "kv_cache"])
    eng.resume(["weights"])
    source = load_causal_lm(ckpts[1], "bfloat16").state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=32 * 1024)
    eng.set_weight_version(2)
    eng.resume(["kv_cache"])
    assert eng.weights_checksum() == checksum_named_tensors(source.items())
    fresh = RolloutEngine(ckpts[1], dtype="bfloat16")
    got = eng.generate(_reqs(temperature=0))
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in fresh.generate(_reqs(temperature=0))]
    assert {r["weight_version"] for r in got} == {2}
