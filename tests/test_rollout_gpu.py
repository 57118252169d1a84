"""Real-GPU paths of the built-in torch rollout engine and DeviceMemory; skipped without CUDA.

Run on a GPU machine with `bash .ci/gpu -k rollout_gpu` (every test marked `gpu`). The
engine runs as it does in production there: CUDA graphs for decode, compiled elementwise ops.
"""

import gc

import pytest
import torch

from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.torch_engine.backend import HOST_ALIGN
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import push_weights

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
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32"))
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


@pytest.mark.parametrize("triton", [False, True])
def test_repeated_calls_of_one_mode_replay_graphs_equal_to_hf(ckpts, triton):
    # Every call after the first replays the graphs of the first (same key). Between calls the
    # small blocks the allocator has free are taken and filled with positions past any slot, so
    # a graph that read a tensor freed after its capture (issue 22) would attend to nothing.
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32", options={"triton": triton}))
    graphs = eng._backend.graphs
    model = load_causal_lm(ckpts[0], "float32").cuda()
    want = [_greedy(model, p, 12) for p in PROMPTS]
    clutter = []
    for call in range(4):
        out = eng.generate(_reqs(temperature=0))
        assert [r["token_ids"] for r in out] == want, f"call {call}"
        if call == 0:
            captures = graphs.num_captures
        assert graphs.num_captures == captures > 0  # replayed, not captured again
        clutter[:] = [torch.full((n,), 1 << 40, device="cuda") for n in (64, 128, 256) for _ in range(128)]


def test_fp32_seeded_samples_do_not_depend_on_the_batch(ckpts):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32", max_batch_size=4))
    alone = [eng.generate(_reqs([p], first_id=i, temperature=1.0))[0] for i, p in enumerate(PROMPTS)]
    crowd = eng.generate(_reqs(PROMPTS * 4, temperature=1.0))  # 12 requests through 4 slots: refills
    assert eng._backend.scheduler.last_stats["admitted_while_decoding"] == 8
    for i, a in enumerate(alone):
        assert crowd[i]["token_ids"] == a["token_ids"]


def test_bf16_logprobs_match_hf_within_bf16_tolerance(ckpts):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="bfloat16"))
    model = load_causal_lm(ckpts[0], "bfloat16").cuda()
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20}):
        out = eng.generate(_reqs(**sampling))
        for prompt, r in zip(PROMPTS, out):
            expected = _teacher_forced(model, prompt, r["token_ids"], sampling["temperature"])
            torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=5e-2, rtol=0)


def test_graph_replay_after_update_weights_uses_the_new_weights(ckpts):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32"))
    reqs = _reqs(temperature=0)
    old = eng.generate(reqs)
    captures = eng._backend.graphs.num_captures
    source = load_causal_lm(ckpts[1], "float32").cuda().state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=64 * 1024)  # GPU buckets, in place
    eng.set_weight_version(3)
    new = eng.generate(reqs)
    assert eng._backend.graphs.num_captures == captures  # the same graphs replayed
    want = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[1], dtype="float32")).generate(reqs)
    assert [r["token_ids"] for r in new] == [r["token_ids"] for r in want] != [r["token_ids"] for r in old]
    assert {r["weight_version"] for r in new} == {3}


def test_release_frees_weights_cache_and_graphs_and_resume_restores(ckpts):
    gc.collect()  # engines of earlier tests (reference cycles) must not count as ours
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="bfloat16", kv_cache_bytes=64 << 20))
    before = eng.generate(_reqs(temperature=0))
    backend = eng._backend
    assert backend.memory.ledger().get("cuda_graph", 0) >= 0 and backend.graphs._graphs
    on_gpu = eng.memory_report()["bytes_in_use"]
    report = eng.release(["weights", "kv_cache"])  # what ppo/loop.py releases; graphs ride along
    assert report["state"] == "released" and eng._released == {"weights", "kv_cache", "cuda_graph"}
    assert on_gpu - report["bytes_in_use"] >= backend.weights_bytes + (64 << 20)
    assert report["bytes_in_use"] - base < (1 << 20) and not backend.graphs._graphs
    assert all(t.device.type == "cpu" and t.is_pinned() for t in backend.weights.storages.values())
    # the host copy: one registered HostBlock of the weights' bytes (each slice aligned), not torch's
    # power-of-two pinned allocation, made at the first release and reused by the next
    host, host_ptrs = backend._host, {k: t.data_ptr() for k, t in backend.weights.storages.items()}
    flat = host._flat
    assert all(t.untyped_storage().data_ptr() == flat.data_ptr() for t in backend.weights.storages.values())
    exact = sum(t.numel() * t.element_size() for t in backend.weights.storages.values())
    assert 0 <= host.nbytes - exact < HOST_ALIGN * len(host_ptrs)
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(_reqs())
    assert eng.resume(["weights", "kv_cache"])["state"] == "ready"
    assert all(t.is_cuda for t in backend.weights.storages.values())
    assert eng.generate(_reqs(temperature=0)) == before
    assert backend.graphs._graphs  # captured again at first use
    eng.release(["weights", "kv_cache"])
    assert backend._host is host and flat.is_pinned()
    assert {k: t.data_ptr() for k, t in backend.weights.storages.items()} == host_ptrs
    eng.resume(["weights", "kv_cache"])
    assert eng.generate(_reqs(temperature=0)) == before


def test_update_weights_from_cpu_buckets_while_the_cache_is_released(ckpts):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="bfloat16"))
    eng.release(["weights", "kv_cache"])
    eng.resume(["weights"])
    source = load_causal_lm(ckpts[1], "bfloat16").state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=32 * 1024)
    eng.set_weight_version(2)
    eng.resume(["kv_cache"])
    assert eng.weights_checksum() == checksum_named_tensors(source.items())
    fresh = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[1], dtype="bfloat16"))
    got = eng.generate(_reqs(temperature=0))
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in fresh.generate(_reqs(temperature=0))]
    assert {r["weight_version"] for r in got} == {2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_kernels_equal_the_torch_reference(dtype):
    import torch.nn.functional as F

    from roles.rollout.torch_engine.decoder import _attention_inputs
    from roles.rollout.torch_engine.kernels import decode_attention, num_splits, rope_and_store

    torch.manual_seed(0)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    heads, kv, d, slots, slot_len = 32, 8, 128, 6, 1300  # Qwen3-4B heads; a slot not a multiple of the tile
    # attention: lengths from 1 (an idle slot) to the whole slot, with and without split-K
    k_cache, v_cache = (torch.randn(slots, kv, slot_len, d, device="cuda", dtype=dtype) for _ in range(2))
    q = torch.randn(5, heads, d, device="cuda", dtype=dtype)
    lengths = torch.tensor([1, 63, 64, 700, 1300], device="cuda")
    assert num_splits(5, kv, slot_len, 132) == 5  # few rows: the long slots are split
    for splits in (1, 3, 5):
        out = decode_attention(q, k_cache, v_cache, lengths, splits=splits)
        for b, n in enumerate(lengths.tolist()):
            ref = F.scaled_dot_product_attention(q[b].view(1, kv, heads // kv, d).float(),
                                                 k_cache[b:b + 1, :, :n].float(), v_cache[b:b + 1, :, :n].float())
            torch.testing.assert_close(out[b].float(), ref.reshape(heads, d), **tol)
    # norm + rope + cache write: the same q, k, v as the torch path, in the right cache cells
    n = 7
    qkv = torch.randn(n, (heads + 2 * kv) * d, device="cuda", dtype=dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.arange(slot_len, device="cuda").float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((emb, emb), -1).cos().to(dtype), torch.cat((emb, emb), -1).sin().to(dtype)
    norms = [torch.rand(d, device="cuda", dtype=dtype) + 0.5 for _ in range(2)]
    positions = torch.tensor([0, 1, 63, 64, 500, 1299, 7], device="cuda")
    slot_of = torch.tensor([0, 1, 2, 3, 4, 5, 1], device="cuda")
    for q_norm, k_norm in (norms, (None, None)):
        k_cache.zero_(), v_cache.zero_()
        q = rope_and_store(qkv, cos, sin, q_norm, k_norm, positions, slot_of, k_cache, v_cache,
                           num_heads=heads, num_kv_heads=kv, eps=1e-6)
        rq, rk, rv = _attention_inputs(qkv, cos[positions], sin[positions], q_norm, k_norm, heads, kv, 1e-6)
        torch.testing.assert_close(q, rq, **tol)
        torch.testing.assert_close(k_cache[slot_of, :, positions], rk, **tol)
        torch.testing.assert_close(v_cache[slot_of, :, positions], rv, atol=0, rtol=0)
        assert int((k_cache != 0).any(-1).sum()) == n * kv  # nothing written elsewhere


def test_triton_decode_equals_torch_decode_and_graphs_stay_bounded(ckpts):
    fused = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32", max_batch_size=4))
    plain = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32", max_batch_size=4,
                                       options={"triton": False}))
    assert fused._backend.scheduler.fused and not plain._backend.scheduler.fused
    for sampling in ({"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}):
        a, b = fused.generate(_reqs(PROMPTS * 3, **sampling)), plain.generate(_reqs(PROMPTS * 3, **sampling))
        assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]
        for x, y in zip(a, b):
            torch.testing.assert_close(x["logprobs"], y["logprobs"], atol=1e-4, rtol=0)
    fused = RolloutEngine(EngineConfig(hf_checkpoint=ckpts[0], dtype="float32", max_batch_size=4))  # no graphs yet
    graphs = fused._backend.graphs
    graphs.max_graphs = 2
    want = fused.generate(_reqs(temperature=0))
    keys = set()
    for sampling in ({"temperature": 1.0}, {"temperature": 1.0, "top_k": 3}, {"temperature": 0}):
        for prompts in (PROMPTS[:1], PROMPTS[:2], PROMPTS):  # batch sizes 1, 2, 4: new graph keys
            fused.generate(_reqs(prompts, **sampling))
            keys |= set(graphs._graphs)
            assert len(graphs._graphs) <= 2
    assert len(keys) >= 9  # the oldest graphs were dropped to make room ...
    assert fused.generate(_reqs(temperature=0)) == want  # ... and recaptured when needed again
