"""The sglang adapter, held to sglang's source.

CPU tests run RolloutEngine(backend="sglang") against tests/fakes/sglang_engine.py, a fake
rebuilt from sglang 0.5.23 (each behaviour cites the sglang file and line it copies). The
GPU test runs sglang's real serializer and FlattenedTensorBucket between a trainer process,
the engine process and two sglang "TP rank" processes on one GPU, as a colocated sync does.
"""

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppo.tiny_model import EOS_ID, load_causal_lm
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout import sglang_backend
from roles.rollout.sglang_backend import flattened_bucket_payloads
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import pack_buckets, push_weights, unpack_bucket
from tests.fakes import sglang_engine

REPO = Path(__file__).resolve().parent.parent
SAVER = {"enable_memory_saver": True}


@pytest.fixture
def fake_sglang(monkeypatch):
    return sglang_engine.install(monkeypatch, eos_id=EOS_ID)


def _engine(ckpt, fake_sglang, **kw):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", **kw))
    return eng, fake_sglang.instances[-1]


def _gen(eng, prompt, **sampling):
    return eng.generate([{"id": 0, "prompt_ids": prompt, "sampling": {"max_new_tokens": 3, **sampling}}])[0]


def test_engine_arguments_are_server_args(ckpt, fake_sglang):
    _, fake = _engine(ckpt, fake_sglang, seed=5, dtype="bfloat16", max_batch_size=32, mem_fraction=0.6,
                      options={"tp_size": 2, "attention_backend": "fa3", **SAVER})
    assert fake.server_args == {
        "model_path": ckpt, "dtype": "bfloat16", "random_seed": 5, "max_running_requests": 32,
        "skip_tokenizer_init": True, "mem_fraction_static": 0.6, "tp_size": 2,
        "attention_backend": "fa3", "enable_memory_saver": True,
    }
    with pytest.raises(TypeError, match="Unexpected keyword argument 'cuda_graph'"):  # not a ServerArgs field
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", options={"cuda_graph": False}))
    with pytest.raises(ValueError, match=r"options \['dtype'\]"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", options={"dtype": "float16"}))
    with pytest.raises(ValueError, match="kv_cache_bytes is for backend 'torch'"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", kv_cache_bytes=1 << 20))


def _greedy(ckpt, prompt, n, dtype="float32"):
    """The checkpoint's greedy tokens and their log-probs, computed here from its weights."""
    model = load_causal_lm(ckpt, dtype)
    seq, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), -1)
            tokens.append(int(logp.argmax()))
            logprobs.append(float(logp[tokens[-1]]))
            seq.append(tokens[-1])
    return tokens, logprobs


def test_generate_translates_requests_and_results(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, fake_sglang, dtype="float32")
    requests = [
        {"id": 4, "prompt_ids": [5, 6], "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 5,
                                                     "max_new_tokens": 6, "stop_token_ids": [9], "seed": 3}},
        {"id": 9, "prompt_ids": [2, 3, 4], "sampling": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}},
    ]
    eng.set_weight_version(7)
    results = eng.generate(requests)
    sent = fake.calls[-1][1]
    assert sent[0] == {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "max_new_tokens": 6,
                       "stop_token_ids": [9], "ignore_eos": False}  # no sampling_seed: sglang would ignore it
    assert sent[1]["ignore_eos"] is True and sent[1]["top_k"] == -1
    assert all(r["weight_version"] == 7 for r in results) and [r["id"] for r in results] == [4, 9]
    assert results[0]["finish_reason"] in ("stop", "length") and len(results[0]["logprobs"]) == len(results[0]["token_ids"])
    # the greedy request is the checkpoint's own greedy continuation, log-probs at T = 1
    tokens, logprobs = _greedy(ckpt, [2, 3, 4], 5)
    assert results[1]["token_ids"] == tokens and results[1]["finish_reason"] == "length"
    assert results[1]["logprobs"] == pytest.approx(logprobs, abs=1e-5)
    # a stop token ends the request and is kept, as sglang's finish_reason "stop" with `matched`
    out = _gen(eng, [2, 3, 4], temperature=0.0, max_new_tokens=8, stop_token_ids=[tokens[1]])
    assert (out["token_ids"], out["finish_reason"]) == (tokens[:2], "stop")


def test_seeds_hold_only_in_deterministic_mode_and_greedy_ignores_them(ckpt, fake_sglang):
    """sglang samples with a request's sampling_seed only under enable_deterministic_inference;
    otherwise the scheduler's generator (seeded once with random_seed) samples every request.
    Greedy decoding draws nothing: no seed changes it."""
    eng, fake = _engine(ckpt, fake_sglang, options={"enable_deterministic_inference": True})
    a, b, a2 = _gen(eng, [1], seed=3, max_new_tokens=6), _gen(eng, [1], seed=4, max_new_tokens=6), \
        _gen(eng, [1], seed=3, max_new_tokens=6)
    assert fake.calls[-1][1][0]["sampling_seed"] == 3
    assert a["token_ids"] == a2["token_ids"] != b["token_ids"]
    engines = [_engine(ckpt, fake_sglang, seed=11)[0] for _ in range(2)]
    a, b = _gen(engines[0], [1], seed=3, max_new_tokens=6), _gen(engines[1], [1], seed=4, max_new_tokens=6)
    assert "sampling_seed" not in fake_sglang.instances[-1].calls[-1][1][0]
    assert a["token_ids"] == b["token_ids"]  # the request's seed is ignored: the engine's generator drew
    assert _gen(engines[0], [1], seed=5, max_new_tokens=6)["token_ids"] != a["token_ids"]  # ... and moved on
    greedy = {tuple(_gen(e, [1], seed=s, temperature=0.0, max_new_tokens=6)["token_ids"])
              for e in (eng, *engines) for s in (3, 4)}
    assert len(greedy) == 1


def test_release_resume_tags_and_memory_saver(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, fake_sglang, options={**SAVER, "enable_weights_cpu_backup": True})
    assert eng.release(["weights", "kv_cache"])["state"] == "released"
    assert fake.calls[-2:] == [("release", ["weights", "kv_cache", "cuda_graph"]), ("flush_cache",)]
    eng.resume(["weights"])
    assert fake.calls[-1] == ("resume", ["weights"]) and fake.offload_tags == {"kv_cache", "cuda_graph"}
    eng.resume(["weights"])  # RolloutEngine skips what is resident: sglang's scheduler would die
    assert fake.calls[-1] == ("resume", ["weights"]) and len([c for c in fake.calls if c[0] == "resume"]) == 1
    eng.resume(["kv_cache"])
    assert fake.calls[-1] == ("resume", ["kv_cache", "cuda_graph"]) and not fake.offload_tags
    plain, _ = _engine(ckpt, fake_sglang)  # without the memory saver sglang would free nothing
    with pytest.raises(RuntimeError, match="enable_memory_saver"):
        plain.release(["kv_cache"])


def test_release_without_cpu_backup_discards_the_weights_until_a_push(ckpt, fake_sglang):
    """torch_memory_saver throws released weights away unless sglang backs them up on the CPU:
    the engine refuses to generate from them, and a whole weight push brings them back."""
    want = _greedy(ckpt, [2, 3], 4)
    for backup in (False, True):
        eng, fake = _engine(ckpt, fake_sglang, dtype="float32",
                            options={**SAVER, "enable_weights_cpu_backup": backup})
        out = _gen(eng, [2, 3], temperature=0.0, max_new_tokens=4, ignore_eos=True)
        assert (out["token_ids"], pytest.approx(want[1], abs=1e-5)) == (want[0], out["logprobs"])
        eng.release(["weights", "kv_cache"])
        eng.resume(["weights", "kv_cache"])
        if backup:  # kept: the same output without a push
            assert _gen(eng, [2, 3], temperature=0.0, max_new_tokens=4, ignore_eos=True)["token_ids"] == want[0]
            continue
        with pytest.raises(RuntimeError, match="threw their contents away.*push the weights"):
            _gen(eng, [2, 3])
        # what sglang itself would generate now: noise, not the checkpoint's policy
        noise = fake.generate(input_ids=[[2, 3]], sampling_params=[{"temperature": 0.0, "max_new_tokens": 4,
                                                                   "ignore_eos": True}], return_logprob=True)[0]
        assert [lp for lp, _, _ in noise["meta_info"]["output_token_logprobs"]] != pytest.approx(want[1], abs=1e-3)
        source = load_causal_lm(ckpt, "float32").state_dict()
        named = list(source.items())
        push_weights(named[:2], eng.update_weights, buffer_bytes=8 * 1024)
        eng.set_weight_version(1)  # a push that missed tensors leaves them noise: still refused
        with pytest.raises(RuntimeError, match=f" {len(named) - 2} tensors"):
            _gen(eng, [2, 3])
        push_weights(named, eng.update_weights, buffer_bytes=8 * 1024)
        eng.set_weight_version(1)  # the whole push brings the policy back
        out = _gen(eng, [2, 3], temperature=0.0, max_new_tokens=4, ignore_eos=True)
        assert out["token_ids"] == want[0] and out["logprobs"] == pytest.approx(want[1], abs=1e-5)


def _die_in_a_child(ckpt: str, call: str) -> subprocess.CompletedProcess:
    script = (f"from tests.fakes.sglang_engine import FakeEngine, MultiprocessingSerializer\n"
              f"e = FakeEngine(model_path={ckpt!r}, enable_memory_saver=True, tp_size=2)\n"
              f"try:\n    {call}\nexcept BaseException as exc:\n    print('caught', type(exc).__name__)\n"
              f"print('alive')\n")
    return subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
@pytest.mark.timeout(300)
def test_where_sglangs_scheduler_dies_the_fakes_process_dies(ckpt):
    """A scheduler exception SIGQUITs the Engine's process, whose handler SIGKILLs itself: no
    caller can catch it (scheduler.py:6369-6373, engine.py:1976-1982)."""
    for call in ("e.resume_memory_occupation(tags=['weights'])",  # never released: KeyError in the scheduler
                 "e.release_memory_occupation(tags=['weights']); e.generate(input_ids=[[1]], "
                 "sampling_params=[{'max_new_tokens': 1}])",  # a forward over unmapped memory
                 "e.begin_weight_update(); e.update_weights_from_tensor(['eA=='], "
                 "load_format='flattened_bucket')",  # one payload for two TP ranks
                 "e.begin_weight_update(); e.update_weights_from_tensor("
                 "[MultiprocessingSerializer.serialize(object(), output_str=True)] * 2, "
                 "load_format='flattened_bucket')"):  # sglang's SafeUnpickler blocks it
        proc = _die_in_a_child(ckpt, call)
        assert proc.returncode == -9, (proc.returncode, proc.stdout, proc.stderr)
        assert "caught" not in proc.stdout and "alive" not in proc.stdout
        assert "Scheduler hit an exception" in proc.stderr


def test_options_sglang_cannot_update_with_are_refused_before_it_starts(ckpt, fake_sglang):
    for options, match in (({"dp_size": 2}, "'dp_size': 2.*data-parallel"),
                           ({"weight_cache_mode": "shared"}, "'weight_cache_mode'.*scheduler dies")):
        with pytest.raises(ValueError, match=match):
            RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", options=options))
    assert fake_sglang.instances == []
    # the fake would fail where sglang does: mid-sync, after the session opened
    fake = fake_sglang(model_path=ckpt, dp_size=2)
    with pytest.raises(AssertionError, match="data-parallel replicas"):
        fake.update_weights_from_tensor([], load_format="flattened_bucket")


def test_fake_accepts_exactly_the_wheels_server_args():
    """sglang_server_args.json is generated from both pinned wheels (gen_server_args.py); every
    Engine keyword we pass is a field of both."""
    from ppo.config.recipes import qwen3_4b_ppo
    from ppo.setup.role_configs import engine_config

    data = json.loads((REPO / "tests/fakes/sglang_server_args.json").read_text())
    assert set(data["versions"]) == {"0.5.21", "0.5.23"} and sglang_engine.VERSION in data["versions"]
    for fields in (set(v["fields"]) for v in data["versions"].values()):
        kwargs = sglang_backend.engine_kwargs("ckpt", dtype="bfloat16", seed=0, max_batch_size=8, mem_fraction=0.5,
                                              options=engine_config(qwen3_4b_ppo(), "ckpt", engine_index=0,
                                                                    dtype="bfloat16").options)
        used = {*kwargs, "disable_cuda_graph", "enable_deterministic_inference", "enable_weights_cpu_backup",
                *sglang_backend.REFUSED_OPTIONS}
        assert used <= fields and len(fields) > 500
    assert sglang_engine.SERVER_ARGS_FIELDS == set(data["versions"][sglang_engine.VERSION]["fields"])
    with pytest.raises(TypeError, match="Unexpected keyword argument 'cuda_graph'"):
        sglang_engine.FakeEngine(model_path="unused", cuda_graph=False)


def test_fake_rejects_what_sglang_rejects(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, fake_sglang, dtype="bfloat16", options={"tp_size": 2})
    named = [("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]
    bucket = next(pack_buckets(named, 1 << 20))
    payloads = flattened_bucket_payloads(named, bucket["flat"], num_ranks=2, sgl=eng._backend.sgl, device=None)
    ok, msg = fake.update_weights_from_tensor(payloads, load_format="flattened_bucket")
    assert not ok and "between begin_weight_update() and end_weight_update()" in msg
    assert fake.begin_weight_update() == (True, "Success")
    assert fake.begin_weight_update()[0] is False  # one session at a time
    with pytest.raises(RuntimeError, match="already read"):  # one payload for every rank
        fake.update_weights_from_tensor([payloads[0]] * 2, load_format="flattened_bucket")
    with pytest.raises(TypeError, match="Unexpected keyword argument 'seed'"):
        fake.generate(input_ids=[[1]], sampling_params=[{"max_new_tokens": 1, "seed": 1}])
    # a missing or blocked payload kills the scheduler: test_where_sglangs_scheduler_dies_...


def test_payload_is_a_flattened_tensor_bucket(fake_sglang):
    """Our payload has FlattenedTensorBucket(named_tensors=...)'s layout (bytes, byte offsets)."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    named = [("a", torch.randn(3, 4, dtype=torch.bfloat16)), ("b", torch.randn(5, dtype=torch.bfloat16))]
    bucket = next(pack_buckets(named, 1 << 20))
    sgl = sglang_backend.import_sglang()
    [payload] = flattened_bucket_payloads(unpack_bucket(bucket), bucket["flat"], num_ranks=1, sgl=sgl, device=None)
    got = sgl.MultiprocessingSerializer.deserialize(payload)
    want = FlattenedTensorBucket(named_tensors=named)
    assert got["metadata"] == want.get_metadata()
    assert torch.equal(got["flattened_tensor"], want.get_flattened_tensor())


def test_weight_bucket_checks_and_no_checksum(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, fake_sglang, dtype="bfloat16")
    cases = [
        ([("model.layers.5.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16))], "unknown tensor"),
        ([("model.norm.weight", torch.zeros(32, dtype=torch.bfloat16))], r"shape \[32\].*\[64\]"),
        ([("model.norm.weight", torch.zeros(64))], "dtype float32.*bfloat16"),
    ]
    for named, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.update_weights(next(pack_buckets(named, 1 << 20)))
    initial = load_causal_lm(ckpt, "bfloat16").state_dict()
    assert all(torch.equal(fake.weights[k], v) for k, v in initial.items()) and fake.session is None
    with pytest.raises(RuntimeError, match="needs backend 'torch'"):
        eng.weights_checksum()


def test_missing_or_untested_sglang_is_a_clear_error(ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail
    with pytest.raises(ImportError, match="needs the sglang package.*backend 'torch'"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang"))
    from importlib import metadata

    real = metadata.version
    for installed, match in ((None, "not installed"), ("0.5.20", "tested with sglang>=0.5.21,<0.5.24, but 0.5.20")):
        def version(dist, installed=installed):
            if dist != "sglang":
                return real(dist)
            if installed is None:
                raise metadata.PackageNotFoundError(dist)
            return installed
        monkeypatch.setattr(metadata, "version", version)
        assert match in sglang_backend.sglang_problem()


def test_pinned_range_is_pyprojects():
    text = (REPO / "pyproject.toml").read_text()
    assert f'sglang = ["sglang{sglang_backend.SGLANG_VERSIONS}"]' in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.timeout(120)
def test_launch_with_sglang_and_no_gpu_exits_2_with_one_message(tmp_path):
    """Before anything starts: one line on stderr, exit 2, no traceback."""
    proc = subprocess.run(
        [sys.executable, "launch.py", "--recipe", "tiny_ppo", "--no-fake-gpus", "--rollout-backend", "sglang",
         "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "rollout backend 'sglang'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.timeout(120)
def test_launch_refuses_sglang_dp_size_before_anything_starts(tmp_path):
    """sglang would take --sglang-dp-size 2 and assert on the first weight bucket, with the
    update session open: the launcher's validation refuses it, one problem naming the flag."""
    proc = subprocess.run(
        [sys.executable, "launch.py", "--recipe", "qwen3_4b_ppo", "--sglang-dp-size", "2",
         "--run-dir", str(tmp_path / "run")],
        cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0] == "invalid configuration (1 problem):" and len(lines) == 2, proc.stderr
    assert lines[1].startswith("  - --sglang-dp-size 2 (engine.sglang_dp_size): must be 1"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not (tmp_path / "run").exists()


# -- GPU: the real weight payload path, trainer -> engine -> sglang ranks, one GPU ------------------

def _real_sglang() -> SimpleNamespace:
    """sglang's serializer, patch and tensor bucket from the installed wheel. Their module
    imports pull sglang's runtime (triton, aiohttp, ...), which the GPU run installs."""
    try:
        import sglang  # noqa: F401  (its __init__ patches transformers and loads sglang.lang)
    except Exception:
        # The srt modules need none of that: load them under a bare `sglang` package.
        import importlib.util
        import types

        spec = importlib.util.find_spec("sglang")
        if spec is None:
            raise
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["sglang"] = pkg
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    return SimpleNamespace(MultiprocessingSerializer=MultiprocessingSerializer,
                           monkey_patch_torch_reductions=monkey_patch_torch_reductions,
                           FlattenedTensorMetadata=FlattenedTensorMetadata,
                           FlattenedTensorBucket=FlattenedTensorBucket)


def _gpu_trainer(to_engine, acks, buffer_bytes: int) -> None:
    """The actor trainer's side of a colocated sync: pack, share by CUDA IPC, wait for the ack."""
    from roles.cuda_ipc import physical_gpu
    from roles.weight_sync import for_receiver

    g = torch.Generator(device="cuda").manual_seed(0)
    named = [(f"layer{i}.weight", torch.randn(1024, 8192 + i, dtype=torch.bfloat16, device="cuda", generator=g))
             for i in range(12)]
    to_engine.put({"want": checksum_named_tensors(named)})

    def send(bucket):
        to_engine.put(for_receiver(bucket, [physical_gpu(0)]))
        acks.get(timeout=60)

    push_weights(named, send, buffer_bytes)
    to_engine.put(None)


def _gpu_rank(payloads, replies) -> None:
    """One sglang TP rank: tp_worker.deserialize_own_rank, then the flattened_bucket load."""
    sgl = _real_sglang()
    weights = {}
    while (payload := payloads.get(timeout=60)) is not None:
        sgl.monkey_patch_torch_reductions()
        data = sgl.MultiprocessingSerializer.deserialize(payload)
        bucket = sgl.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        for name, tensor in bucket.reconstruct_tensors():
            weights[name] = tensor.clone()  # model.load_weights copies into the parameters
        del data, bucket
        torch.cuda.synchronize()
        replies.put("loaded")
    replies.put(checksum_named_tensors(weights.items()))


def _legacy_payload(named, flat, sgl) -> str:
    """What the adapter sent before this fix: the received bucket, serialized as is."""
    metadata, start = [], 0
    for name, tensor in named:
        metadata.append(sgl.FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=flat.dtype,
                                                    start_idx=start, end_idx=start + tensor.numel(),
                                                    numel=tensor.numel()))
        start += tensor.numel()
    return sgl.MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)


@pytest.mark.gpu
@pytest.mark.timeout(100)
def test_colocated_sync_through_sglangs_real_payload_path():
    from roles.weight_sync import received

    try:
        sgl = _real_sglang()
    except ImportError as e:
        pytest.skip(f"needs sglang{sglang_backend.SGLANG_VERSIONS} importable (the GPU run installs the "
                    f"wheel without its deps, see docs/benchmarks.md): {e}")
    ctx = mp.get_context("spawn")
    to_engine, acks = ctx.Queue(), ctx.Queue()
    rank_in, rank_out = [ctx.Queue(), ctx.Queue()], [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=_gpu_trainer, args=(to_engine, acks, 64 << 20), daemon=True)]
    procs += [ctx.Process(target=_gpu_rank, args=(rank_in[r], rank_out[r]), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        want = to_engine.get(timeout=60)["want"]
        legacy_error, seconds, nbytes, buckets = None, 0.0, 0, 0
        while (msg := to_engine.get(timeout=60)) is not None:
            bucket = received(msg)  # RolloutEngine.update_weights maps the IPC handle first
            assert bucket["flat"].is_cuda
            named = unpack_bucket(bucket)
            if legacy_error is None:
                with pytest.raises(RuntimeError, match="received from another process") as info:
                    _legacy_payload(named, bucket["flat"], sgl)
                legacy_error = str(info.value).splitlines()[0]
                del info  # its traceback holds the mapped bucket; the trainer may exit first
            t0 = time.perf_counter()
            payloads = flattened_bucket_payloads(named, bucket["flat"], num_ranks=2, sgl=sgl,
                                                 device=torch.device("cuda", 0))
            seconds += time.perf_counter() - t0
            nbytes += bucket["flat"].numel() * bucket["flat"].element_size()
            buckets += 1
            for r in range(2):
                rank_in[r].put(payloads[r])
            assert [rank_out[r].get(timeout=60) for r in range(2)] == ["loaded", "loaded"]
            del payloads, bucket, named
            acks.put("ack")
        for r in range(2):
            rank_in[r].put(None)
        got = [rank_out[r].get(timeout=60) for r in range(2)]
        assert got[0] == want and got[1] == want  # every rank holds the trainer's exact weights
        print(f"\nSGLANG_PAYLOAD old path: {legacy_error!r}; new path: {buckets} buckets, "
              f"{nbytes / 2**20:.0f} MiB, clone+serialize x2 ranks {seconds * 1e3:.1f} ms "
              f"({nbytes / seconds / 1e9:.1f} GB/s)")
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0, p
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def test_driver_starts_sglang_engines_with_the_recipes_settings():
    from dataclasses import replace

    from ppo.setup.job import rollout_backend_problem
    from ppo.setup.role_configs import engine_config
    from ppo.config.recipes import qwen3_4b_ppo, tiny_ppo

    def settings(cfg):
        return engine_config(cfg, "ckpt", engine_index=1, dtype="bfloat16")

    cfg = qwen3_4b_ppo()  # colocated: engines offload, so the memory saver is on
    assert settings(cfg) == EngineConfig(hf_checkpoint="ckpt", backend="sglang", engine_index=1, seed=42,
                                         dtype="bfloat16", max_batch_size=512, mem_fraction=0.8, max_request_retries=3,
                                         options={"tp_size": 1, "enable_memory_saver": True})
    cfg = replace(cfg, engine=replace(cfg.engine, rollout_num_gpus_per_engine=2, sglang_max_running_requests=None,
                                      sglang_disable_cuda_graph=True, sglang_enable_deterministic_inference=True))
    assert settings(cfg).options == {"tp_size": 2, "enable_memory_saver": True,
                                     "disable_cuda_graph": True, "enable_deterministic_inference": True}
    assert settings(cfg).max_batch_size == 64  # unset: one rollout's samples (8 prompts x 8)
    tiny = settings(tiny_ppo())
    assert (tiny.backend, tiny.max_batch_size, tiny.mem_fraction, tiny.options) == ("torch", 1024, None, {})
    # the same flag puts the built-in engine in its batch-invariant mode
    tiny = tiny_ppo()
    tiny = replace(tiny, engine=replace(tiny.engine, sglang_enable_deterministic_inference=True))
    assert settings(tiny).options == {"batch_invariant": True}
    assert rollout_backend_problem(tiny_ppo()) is None


def test_weight_check_is_refused_with_sglang_at_config_time():
    from ppo.config.cli import parse_args
    from ppo.config import ConfigError

    with pytest.raises(ConfigError, match="check-weight-update-equal.*no exact read-back"):
        parse_args(["--recipe", "qwen3_4b_ppo", "--check-weight-update-equal"])


# -- tiny_ppo on the fake sglang: colocated, offloading, a critic-only step ---------------------------

@pytest.mark.timeout(600)
def test_tiny_ppo_on_fake_sglang_rolls_out_the_actors_policy_after_a_critic_only_step(tmp_path, monkeypatch):
    """The engines release their weights after each rollout and sglang throws them away; the
    rollouts after the critic-only step must still come from the actor's weights: the engines'
    log-probs of their own samples equal the actor's (rollout/log_probs_diff), which they cannot
    from noise. Each engine's rollout-0 call (its third: the two eval sets come first) is aborted as
    sglang raises an out-of-memory retract: its requests are issued again and counted."""
    import ppo.setup.job
    from ppo.config.serialize import override
    from ppo.loop import train
    from ppo.config.recipes import tiny_ppo

    # role processes import the fake as `sglang` (spawned children inherit sys.path)
    monkeypatch.syspath_prepend(str(sglang_engine.write_package(tmp_path / "site")))
    monkeypatch.setenv(sglang_engine.ABORTS_ENV, json.dumps({2: sglang_engine.OOM_RETRACT}))
    # validation keeps sglang off fake GPUs and the job wants CUDA for it: the fake needs neither
    monkeypatch.setattr(ppo.setup.job, "rollout_backend_problem", lambda cfg: None)
    cfg = override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=3, num_critic_only_steps=1,
                   rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=32, micro_batch_size=32,
                   rollout_backend="sglang")
    assert cfg.placement.colocate and ppo.config.engines_discard_weights(cfg)
    history = train(cfg)
    # step 0 trains the critic only, so step 1 rolls out from weights released and resumed unchanged
    assert [h["rollout/weight_version"] for h in history] == [0, 1, 2]
    assert "train/pg_loss" not in history[0] and "train/pg_loss" in history[1]
    diffs = [h["rollout/log_probs_diff"] for h in history]
    assert all(d < 1e-4 for d in diffs), diffs  # from discarded weights it is ~1 nat per token
    # the raise lost each engine's whole call: every request of rollout 0 was issued again, once
    assert [h["rollout/aborted_requests"] for h in history] == [32, 0, 0]


def test_streamed_requests_are_each_their_own_async_generate_and_equal_the_blocking_ones(ckpt, fake_sglang):
    """RolloutEngine.stream on sglang: every request goes at once as one async_generate of its token
    ids (what sglang's scheduler batches and its radix cache matches); a second request sent while
    the first is out joins it; an abort sglang raises for one request re-issues that one alone."""
    eng, fake = _engine(ckpt, fake_sglang, dtype="float32")
    first = {"id": 0, "prompt_ids": [2, 3, 4], "sampling": {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}}
    second = {"id": 1, "prompt_ids": [5, 6], "sampling": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}}
    got = eng.stream("s", [first], wait_s=0.0)
    fake.abort_prompts[sum(second["prompt_ids"])] = [{"message": "retracted", "status_code": 400}]
    got += eng.stream("s", [second], wait_s=0.0)
    while len(got) < 2:
        got += eng.stream("s", [], wait_s=0.0)
    sent = [c for c in fake.calls if c[0] == "async_generate"]
    assert len(sent) == 3 and all(isinstance(c[1], dict) for c in sent)  # the abort's retry is the third
    by_id = {r["id"]: r for r in got}
    assert by_id[1]["num_aborts"] == 1 and by_id[0]["num_aborts"] == 0
    blocking = {r["id"]: r for r in eng.generate([first, second])}
    for rid in (0, 1):
        assert by_id[rid]["token_ids"] == blocking[rid]["token_ids"]
        assert by_id[rid]["logprobs"] == pytest.approx(blocking[rid]["logprobs"], abs=1e-6)
    assert by_id[0]["token_ids"] == _greedy(ckpt, [2, 3, 4], 5)[0]
    # a release waits the stream's requests out first (sglang's scheduler dies releasing under them)
    eng2, fake2 = _engine(ckpt, fake_sglang, dtype="float32", options=SAVER)
    eng2.stream("t", [first], wait_s=0.0)
    eng2.release(["kv_cache"])
    assert fake2.pending_requests == 0 and eng2._backend._streaming == {}
