"""The built-in torch rollout engine on the CPU: HF equality, sampling semantics, log-prob
invariant, continuous batching, weight updates."""

import json

import pytest
import torch

from ppo.tiny_model import EOS_ID, build_tiny_checkpoint, load_causal_lm
from roles.rollout import EngineConfig, RolloutEngine
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import pack_buckets, push_weights

PROMPTS = [[5, 14, 6, 17], [9], [7, 8, 9, 10, 11, 12, 13], [20, 21]]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny1")), seed=1)


@pytest.fixture(scope="module")
def engine(ckpt):
    return RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=0))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_causal_lm(ckpt, "float32")


def _reqs(prompts, first_id=0, **sampling):
    return [{"id": first_id + i, "prompt_ids": p, "sampling": dict(sampling)} for i, p in enumerate(prompts)]


def _greedy_reference(model, prompt, n):
    """Slow twin: greedy decoding by full re-forward, no cache, no padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _teacher_forced_logprobs(model, prompt, response, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()  # [T, V]
    logits = logits[len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_same_seed_same_sample_whatever_the_batch(engine):
    alone = engine.generate(_reqs([PROMPTS[0]], max_new_tokens=12, seed=7, ignore_eos=True))[0]
    mixed = engine.generate(
        _reqs(PROMPTS[1:], first_id=10, max_new_tokens=12, ignore_eos=True)
        + [{"id": 99, "prompt_ids": PROMPTS[0], "sampling": {"max_new_tokens": 12, "seed": 7, "ignore_eos": True}}]
    )[-1]
    assert mixed["id"] == 99
    assert mixed["token_ids"] == alone["token_ids"]
    torch.testing.assert_close(mixed["logprobs"], alone["logprobs"], atol=1e-5, rtol=0)
    other = engine.generate(_reqs([PROMPTS[0]], max_new_tokens=12, seed=8, ignore_eos=True))[0]
    assert other["token_ids"] != alone["token_ids"]


def test_under_mps_an_engine_whose_gemms_come_out_wrong_stops_before_generating(engine, monkeypatch):
    """As the trainers (tests/test_trainer.py): each generate first checks a few GEMMs under MPS."""
    import roles.compute_check as cc

    reqs = _reqs(PROMPTS[:1], max_new_tokens=2, seed=3)
    monkeypatch.setattr(cc, "under_mps", lambda: True)
    monkeypatch.setenv(cc.MPS_SHARE_ENV, "100")
    monkeypatch.setattr(cc, "wrong_gemms", lambda device, matmul, shapes: [("forward", *shapes[0])])
    calls = engine._num_generate_calls
    with pytest.raises(cc.ComputeWrong, match=r"^rollout engine 0: in its MPS client \(100% of the SMs\)"):
        engine.generate(reqs)
    assert engine.state == "ready"
    monkeypatch.setattr(cc, "wrong_gemms", lambda device, matmul, shapes: [])
    assert len(engine.generate(reqs)) == 1 and engine._num_generate_calls == calls + 2


def test_unseeded_requests_reproduce_per_engine_seed(ckpt):
    runs = []
    for seed, index in [(3, 0), (3, 0), (4, 0), (3, 1)]:
        eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", seed=seed, engine_index=index))
        runs.append([r["token_ids"] for r in eng.generate(_reqs(PROMPTS, max_new_tokens=10, ignore_eos=True))])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2] and runs[0] != runs[3]


def test_temperature_zero_and_top_k_one_are_greedy(engine, model):
    expected = [_greedy_reference(model, p, 9) for p in PROMPTS]
    for sampling in ({"temperature": 0.0}, {"temperature": 1.3, "top_k": 1}, {"temperature": 0.8, "top_p": 1e-6}):
        out = engine.generate(_reqs(PROMPTS, max_new_tokens=9, ignore_eos=True, **sampling))
        assert [r["token_ids"] for r in out] == expected, sampling


def test_stop_token_ends_with_stop_and_ignore_eos_disables_it(engine, model):
    greedy = _greedy_reference(model, PROMPTS[2], 12)
    stop = greedy[4]
    cut = greedy.index(stop) + 1
    out = engine.generate(_reqs([PROMPTS[2]], temperature=0, max_new_tokens=12, stop_token_ids=[stop]))[0]
    assert (out["token_ids"], out["finish_reason"]) == (greedy[:cut], "stop")
    out = engine.generate(_reqs([PROMPTS[2]], temperature=0, max_new_tokens=12, stop_token_ids=[stop],
                                ignore_eos=True))[0]
    assert (out["token_ids"], out["finish_reason"]) == (greedy, "length")


def test_max_new_tokens_gives_length_and_eos_stops(engine):
    out = engine.generate(_reqs(PROMPTS * 3, temperature=1.5, max_new_tokens=30))
    reasons = {r["finish_reason"] for r in out}
    assert reasons == {"stop", "length"}  # random tiny model: eos (1/47 a token) hits some rows
    for r in out:
        if r["finish_reason"] == "stop":
            assert r["token_ids"][-1] == EOS_ID and EOS_ID not in r["token_ids"][:-1]
        else:
            assert len(r["token_ids"]) == 30 and EOS_ID not in r["token_ids"]
        assert len(r["logprobs"]) == len(r["token_ids"])


@pytest.mark.parametrize("sampling", [
    {"temperature": 1.0},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 5},
    {"temperature": 0.0},
])
def test_logprobs_equal_teacher_forced_forward(engine, model, sampling):
    # The invariant PPO needs: old log-probs recomputed by the trainer equal the engine's.
    out = engine.generate(_reqs(PROMPTS, max_new_tokens=16, ignore_eos=True, **sampling))
    for prompt, r in zip(PROMPTS, out):
        expected = _teacher_forced_logprobs(model, prompt, r["token_ids"], sampling["temperature"])
        torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=2e-5, rtol=0)


def test_top_k_samples_stay_in_the_top_k(engine, model):
    out = engine.generate(_reqs([PROMPTS[0]] * 6, temperature=2.0, top_k=3, max_new_tokens=1))
    with torch.no_grad():
        top3 = set(model(torch.tensor([PROMPTS[0]])).logits[0, -1].topk(3).indices.tolist())
    assert {r["token_ids"][0] for r in out} <= top3


def test_left_padding_matches_one_by_one(engine):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.95}):
        batch = engine.generate(
            [{"id": i, "prompt_ids": p, "sampling": {"max_new_tokens": 14, "seed": 100 + i, **sampling}}
             for i, p in enumerate(PROMPTS)])
        for i, p in enumerate(PROMPTS):
            single = engine.generate(
                [{"id": i, "prompt_ids": p, "sampling": {"max_new_tokens": 14, "seed": 100 + i, **sampling}}])[0]
            assert single["token_ids"] == batch[i]["token_ids"]
            assert single["finish_reason"] == batch[i]["finish_reason"]
            torch.testing.assert_close(single["logprobs"], batch[i]["logprobs"], atol=1e-5, rtol=0)


def test_small_kv_budget_gives_fewer_slots_without_changing_results(ckpt, engine):
    reqs = _reqs(PROMPTS * 2, max_new_tokens=8, ignore_eos=True, temperature=0.9)
    for i, r in enumerate(reqs):
        r["sampling"]["seed"] = i
    per_token = engine._backend.kv_bytes_per_token
    small = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=3,
                                       kv_cache_bytes=2 * 15 * per_token))
    assert [r["token_ids"] for r in small.generate(reqs)] == [r["token_ids"] for r in engine.generate(reqs)]
    stats = small._backend.scheduler.last_stats
    assert (stats["num_slots"], stats["slot_len"]) == (2, 15)  # longest prompt 7 + 8 new tokens
    assert stats["admitted_while_decoding"] == len(reqs) - 2
    with pytest.raises(ValueError, match="id=0.*KV cache"):
        small.generate(_reqs([[5] * 30], max_new_tokens=20))


def test_continuous_batching_refills_slots_and_returns_each_request_once_in_order(ckpt, engine):
    # 10 requests of different lengths through 3 slots: finished slots take waiting requests
    # within the call, so all 3 slots stay busy until the waiting queue is empty.
    lengths = [3, 11, 5, 2, 9, 7, 4, 12, 6, 8]
    reqs = [{"id": 100 - i, "prompt_ids": PROMPTS[i % 4],
             "sampling": {"max_new_tokens": n, "ignore_eos": True, "seed": i, "temperature": 1.0}}
            for i, n in enumerate(lengths)]
    three = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=3))
    out = three.generate(reqs)
    assert [r["id"] for r in out] == [r["id"] for r in reqs]
    assert [len(r["token_ids"]) for r in out] == lengths
    stats = three._backend.scheduler.last_stats
    assert stats["num_slots"] == 3 and stats["admitted_while_decoding"] == len(reqs) - 3
    # decode tokens = all tokens less each request's first (sampled at prefill)
    assert stats["busy_steps"] == sum(lengths) - len(lengths)
    # the batch is full except in the tail, when nothing waits: at most 2 idle slots for the
    # last max_new_tokens steps
    assert stats["slot_steps"] - stats["busy_steps"] <= 2 * max(lengths)
    assert stats["busy_steps"] / stats["slot_steps"] > 0.75
    # each request's tokens are those it gets alone in a roomy engine
    alone = [engine.generate([r])[0] for r in reqs]
    assert [r["token_ids"] for r in out] == [a["token_ids"] for a in alone]
    for r, a in zip(out, alone):
        torch.testing.assert_close(r["logprobs"], a["logprobs"], atol=1e-5, rtol=0)


def test_longest_max_new_tokens_are_admitted_first_so_the_tail_is_short(ckpt, engine):
    # FIFO would start the one long request last, after the short ones, and run it alone for
    # 12 steps; admitted first, it runs beside them and the call takes its 12 steps in all.
    lengths = [2] * 6 + [12]
    reqs = [{"id": i, "prompt_ids": PROMPTS[i % 4],
             "sampling": {"max_new_tokens": n, "ignore_eos": True, "seed": i, "temperature": 1.0}}
            for i, n in enumerate(lengths)]
    three = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=3))
    out = three.generate(reqs)
    assert [r["id"] for r in out] == list(range(len(lengths))) and [len(r["token_ids"]) for r in out] == lengths
    assert three._backend.scheduler.last_stats["decode_steps"] == max(lengths) - 1  # the first token is prefill's
    assert [r["token_ids"] for r in out] == [engine.generate([r])[0]["token_ids"] for r in reqs]


def test_decode_steps_are_built_once_per_graph_key_and_hold_only_static_buffers(ckpt):
    """A CUDA graph replays the addresses its capture read: a decode step may hold no tensor of its
    own (one freed after the capture is read freed), only views of the slot state, the KV cache, the
    weights and the rope tables, and each key's step is built once and kept with its graph. On the
    CPU the same steps run, uncaptured."""
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=2))
    backend, built = eng._backend, []
    build = backend.scheduler._step
    backend.scheduler._step = lambda key: built.append(key) or build(key)
    for sampling in ({"temperature": 0}, {"temperature": 0}, {"temperature": 1.0, "top_p": 0.9}):
        eng.generate(_reqs(PROMPTS[:2], max_new_tokens=6, ignore_eos=True, seed=1, **sampling))
    kept = backend.graphs._graphs
    assert len(built) == len(set(built)) == len(kept) >= 2  # many sync rounds, one build per key
    state, decoder = backend.scheduler.state, backend.scheduler.decoder
    static = [*vars(state).values(), *vars(state.rows).values(), backend.cache._buffer,
              *backend.weights.storages.values(), decoder.cos, decoder.sin]
    static = {t.untyped_storage().data_ptr() for t in static if isinstance(t, torch.Tensor)}
    for step, _ in kept.values():
        held = [t for t in map(_cell_value, step.__closure__) if isinstance(t, torch.Tensor)]
        assert held and all(t.untyped_storage().data_ptr() in static for t in held)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a variable of the branch not taken (the fused kernels' on the CPU)
        return None


def test_syncing_every_few_steps_changes_nothing(ckpt, engine):
    # On a GPU the host looks at the decode only every `sync_every` steps: rows that stopped
    # meanwhile run on as garbage, idle slots run too. Results must not show it, call after call.
    lazy = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=3, options={"sync_every": 5}))
    for call in range(3):
        reqs = _reqs(PROMPTS * 2, first_id=10 * call, max_new_tokens=9 + call, temperature=1.0)
        for r in reqs:
            r["sampling"].update(stop_token_ids=[7, 8, 9], seed=r["id"])  # seeded: the engines' call counts differ
        got, want = lazy.generate(reqs), engine.generate(reqs)
        assert [(r["token_ids"], r["finish_reason"]) for r in got] == [(r["token_ids"], r["finish_reason"]) for r in want]
        assert {r["finish_reason"] for r in got} == {"stop", "length"}
        for a, b in zip(got, want):
            torch.testing.assert_close(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)


def test_counter_rng_is_uniform_and_keyed_by_seed_and_position():
    from roles.rollout.torch_engine.sampler import uniform

    seeds = torch.arange(4000) % 40
    positions = torch.arange(4000) // 40
    u = uniform(seeds, positions)
    assert 0 <= float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.02 and len(set(u.tolist())) > 3990
    assert torch.equal(u[:40], uniform(seeds[:40], positions[:40]))  # no hidden state
    assert torch.equal(uniform(torch.tensor([7, 7]), torch.tensor([3, 3])), uniform(torch.tensor([7]), torch.tensor([3])).repeat(2))


def _invert(probs, u):
    """Slow twin of the sampler's blocked CDF inversion: one scan over the whole row."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=cdf.shape[-1] - 1)


def test_blocked_cdf_inversion_equals_the_full_scan_and_never_draws_a_zero():
    from roles.rollout.torch_engine.sampler import _invert_blocked

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(2000, 1000, generator=g), -1)  # 1000: not a multiple of 128
    u = torch.rand(2000, generator=g)
    full, blocked = _invert(probs, u), _invert_blocked(probs, u)
    assert (full == blocked).float().mean() > 0.999  # only float-rounding ties may differ
    assert int(blocked.max()) < 1000
    # cut rows: most tokens zeroed, and u at the ends of [0, 1), where rounding bites
    cut = probs.masked_fill(torch.rand(2000, 1000, generator=g) < 0.97, 0.0)
    cut[:, 0] = 0.0
    for edge in (torch.zeros(2000), torch.full((2000,), 1 - 2**-24), u):
        drawn = _invert_blocked(cut, edge)
        assert bool((cut.gather(1, drawn[:, None]) > 0).all())


def test_tied_embeddings_checkpoint_matches_hf(tmp_path):
    tied = build_tiny_checkpoint(str(tmp_path / "tied"), seed=2, tie_word_embeddings=True)
    eng, model = RolloutEngine(EngineConfig(hf_checkpoint=tied, dtype="float32")), load_causal_lm(tied, "float32")
    assert eng.weights_checksum() == checksum_named_tensors(model.state_dict().items())
    out = eng.generate(_reqs(PROMPTS, temperature=0, max_new_tokens=6, ignore_eos=True))
    assert [r["token_ids"] for r in out] == [_greedy_reference(model, p, 6) for p in PROMPTS]


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}},  # 4.x spelling
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},  # transformers 5
], ids=["yarn-4.x", "llama3-5.x"])
def test_scaled_rope_checkpoint_matches_hf(tmp_path, rope):
    scaled = build_tiny_checkpoint(str(tmp_path / "scaled"), seed=3)
    config_path = tmp_path / "scaled" / "config.json"
    config = {k: v for k, v in json.loads(config_path.read_text()).items() if k not in ("rope_parameters", "rope_theta")}
    config_path.write_text(json.dumps({**config, "rope_theta": 10000.0, **rope}))
    eng, model = RolloutEngine(EngineConfig(hf_checkpoint=scaled, dtype="float32")), load_causal_lm(scaled, "float32")
    assert model.config.rope_parameters["rope_type"] == eng._backend.spec.rope.kind != "default"
    out = eng.generate(_reqs(PROMPTS, temperature=1.0, max_new_tokens=8, ignore_eos=True))
    for prompt, r in zip(PROMPTS, out):
        expected = _teacher_forced_logprobs(model, prompt, r["token_ids"], 1.0)
        torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=2e-5, rtol=0)


def test_update_weights_by_buckets_matches_source_checksum(ckpt, other_ckpt):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16"))
    source = load_causal_lm(other_ckpt, "bfloat16")
    expected = checksum_named_tensors(source.state_dict().items())
    assert eng.weights_checksum() != expected
    acks = []
    totals = push_weights(source.state_dict().items(), lambda b: acks.append(eng.update_weights(b)),
                          buffer_bytes=16 * 1024)
    assert totals["num_buckets"] > 3 and sum(a["num_tensors"] for a in acks) == totals["num_tensors"]
    assert eng.weights_checksum() == expected
    eng.set_weight_version(1)
    fresh = RolloutEngine(EngineConfig(hf_checkpoint=other_ckpt, dtype="bfloat16"))
    reqs = _reqs(PROMPTS, temperature=0, max_new_tokens=8, ignore_eos=True)
    got, want = eng.generate(reqs), fresh.generate(reqs)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert {r["weight_version"] for r in got} == {1} and eng.weight_version() == 1


def test_update_weights_rejects_bad_tensors_before_writing_any(engine):
    before = engine.weights_checksum()
    good = ("model.norm.weight", torch.zeros(64))
    cases = [
        ([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))], "unknown tensor 'model.layers.9"),
        ([good, ("model.embed_tokens.weight", torch.zeros(47, 32))], r"'model.embed_tokens.weight' has shape \[47, 32\]"),
    ]
    for named, match in cases:
        for bucket in pack_buckets(named, 1 << 20):
            with pytest.raises(ValueError, match=match):
                engine.update_weights(bucket)
    bf16 = next(pack_buckets(
        [("model.norm.weight", torch.zeros(64, dtype=torch.bfloat16))], 1 << 20))
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype bfloat16.*float32"):
        engine.update_weights(bf16)
    assert engine.weights_checksum() == before


@pytest.mark.parametrize("bad, match", [
    ({"id": 0, "prompt_ids": [1], "sampling": {"temprature": 1.0}}, "unknown sampling keys"),
    ({"id": 0, "prompt_ids": [1], "sampling": {"top_k": 0}}, "top_k=0"),
    ({"id": 0, "prompt_ids": [1], "sampling": {"top_p": 0}}, "top_p=0"),
    ({"id": 0, "prompt_ids": [1], "sampling": {"temperature": -1}}, "temperature=-1"),
    ({"id": 0, "prompt_ids": [1], "sampling": {"max_new_tokens": 0}}, "max_new_tokens=0"),
    ({"id": 0, "prompt_ids": [47], "sampling": {}}, r"\[0, 47\)"),
    ({"id": 0, "prompt_ids": [], "sampling": {}}, "non-empty"),
    ({"id": 0, "prompt_ids": [1] * 60, "sampling": {"max_new_tokens": 5}}, "max_position_embeddings 64"),
])
def test_bad_requests_are_rejected_with_the_field(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        engine.generate([bad])


def test_duplicate_ids_are_rejected(engine):
    with pytest.raises(ValueError, match="duplicate id 3"):
        engine.generate(_reqs([[1], [2]], first_id=3, max_new_tokens=2)[:1] * 2)


def test_constructor_validates(ckpt, monkeypatch):
    with pytest.raises(ValueError, match="backend='vllm'"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="vllm"))
    with pytest.raises(ValueError, match="dtype='int8'"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="int8"))
    with pytest.raises(ValueError, match="unknown options"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, options={"tp_size": 2}))
    with pytest.raises(ValueError, match="not both"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, kv_cache_bytes=1 << 20, mem_fraction=0.5))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="on the CPU give kv_cache_bytes"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, mem_fraction=0.5))


def test_a_checkpoint_tensor_without_a_place_is_refused_by_name_unless_ignored(ckpt, tmp_path, model):
    import shutil

    from safetensors.torch import save_file

    for extra, refused in (("model.layers.0.self_attn.q_proj.bias", True),  # a Qwen2 bias in a Qwen3
                           ("model.layers.1.self_attn.rotary_emb.inv_freq", False)):  # old checkpoints keep it
        copy = shutil.copytree(ckpt, tmp_path / extra)
        save_file({extra: torch.ones(8)}, str(copy / "zz-extra.safetensors"))
        if refused:
            with pytest.raises(ValueError, match=rf"backend 'torch': checkpoint tensor '{extra}' has no place in "
                                                 r"the qwen3 model that config.json describes"):
                RolloutEngine(EngineConfig(hf_checkpoint=str(copy), dtype="float32"))
        else:
            out = RolloutEngine(EngineConfig(hf_checkpoint=str(copy), dtype="float32")).generate(
                _reqs([PROMPTS[0]], max_new_tokens=4, temperature=0))
            assert out[0]["token_ids"] == _greedy_reference(model, PROMPTS[0], 4)
