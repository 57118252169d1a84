"""The sglang adapter against a contract fake of sglang's in-process Engine.

sglang cannot run here, so `FakeSglangEngine` stands in for it: the same method names and
keyword arguments as `sglang.Engine` (generate, release/resume_memory_occupation,
update_weights_from_tensor, flush_cache), sglang's SamplingParams checks, and outputs in
sglang's format (`output_ids`, `meta_info.output_token_logprobs` as (logprob, id, text),
`meta_info.finish_reason` dicts). Installed as the `sglang` modules for each test.
"""

import base64
import pickle
import sys
import types
from dataclasses import dataclass

import pytest
import torch

from ppo.tiny_model import EOS_ID, load_causal_lm
from roles.rollout import RolloutEngine
from roles.weight_sync import pack_buckets, push_weights

# sglang.srt.sampling.sampling_params.SamplingParams keywords
SGLANG_SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}
VOCAB = 47


@dataclass
class FlattenedTensorMetadata:  # sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class MultiprocessingSerializer:  # sglang.srt.utils.MultiprocessingSerializer (pickle, base64 for str)
    @staticmethod
    def serialize(obj, output_str: bool = False):
        data = pickle.dumps(obj)
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data):
        return pickle.loads(base64.b64decode(data) if isinstance(data, str) else data)


class FakeSglangEngine:
    instances: list = []

    def __init__(self, **server_args):
        self.server_args = server_args
        self.paused: set[str] = set()
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[tuple] = []
        self.abort_ids: set[int] = set()
        FakeSglangEngine.instances.append(self)

    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None):
        assert prompt is None and isinstance(input_ids[0], list) and not stream
        if self.paused:
            raise RuntimeError(f"generate with paused memory {self.paused}")  # a real crash
        self.calls.append(("generate", sampling_params))
        return [self._one(ids, sp, return_logprob) for ids, sp in zip(input_ids, sampling_params)]

    def _one(self, ids, sp, return_logprob):
        assert set(sp) <= SGLANG_SAMPLING_KEYS, set(sp) - SGLANG_SAMPLING_KEYS
        assert sp["temperature"] >= 0 and 0 < sp["top_p"] <= 1 and (sp["top_k"] == -1 or sp["top_k"] >= 1)
        out, finish = [], None
        for i in range(sp["max_new_tokens"]):
            out.append((sum(ids) * 7 + 3 * i + sp.get("sampling_seed", 0)) % VOCAB)
            if len(out) >= sp["max_new_tokens"]:
                finish = {"type": "length", "length": sp["max_new_tokens"]}
            elif not sp.get("ignore_eos") and out[-1] in set(sp.get("stop_token_ids") or []) | {EOS_ID}:
                finish = {"type": "stop", "matched": out[-1]}
            if finish:
                break
        if sum(ids) in self.abort_ids:
            finish = {"type": "abort", "message": "aborted by test"}
        meta = {"id": "rid", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out)}
        if return_logprob:
            meta["output_token_logprobs"] = [(-(i + 1) / 10, t, None) for i, t in enumerate(out)]
        return {"output_ids": out, "meta_info": meta}

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))
        self.paused.update(tags)

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))
        self.paused.difference_update(tags)

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == "flattened_bucket"
        assert len(named_tensors) == self.server_args.get("tp_size", 1)  # one payload per TP rank
        self.calls.append(("update_weights", flush_cache))
        if "weights" in self.paused:
            return False, "weights are released"
        bucket = MultiprocessingSerializer.deserialize(named_tensors[0])
        flat = bucket["flattened_tensor"]
        for m in bucket["metadata"]:
            assert m.dtype == flat.dtype and m.end_idx - m.start_idx == m.numel
            self.weights[m.name] = flat[m.start_idx:m.end_idx].reshape(m.shape).clone()
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache",))


@pytest.fixture
def fake_sglang(monkeypatch):
    FakeSglangEngine.instances.clear()
    modules = {
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.utils": types.ModuleType("sglang.srt.utils"),
        "sglang.srt.weight_sync": types.ModuleType("sglang.srt.weight_sync"),
        "sglang.srt.weight_sync.tensor_bucket": types.ModuleType("sglang.srt.weight_sync.tensor_bucket"),
    }
    modules["sglang"].Engine = FakeSglangEngine
    modules["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
    modules["sglang.srt.weight_sync.tensor_bucket"].FlattenedTensorMetadata = FlattenedTensorMetadata
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return FakeSglangEngine


def _engine(ckpt, **kw):
    eng = RolloutEngine(ckpt, backend="sglang", **kw)
    return eng, FakeSglangEngine.instances[-1]


def test_engine_arguments(ckpt, fake_sglang):
    _, fake = _engine(ckpt, seed=5, dtype="bfloat16", max_batch_size=32, mem_fraction=0.6,
                      options={"tp_size": 2, "attention_backend": "fa3"})
    assert fake.server_args == {
        "model_path": ckpt, "dtype": "bfloat16", "random_seed": 5, "max_running_requests": 32,
        "skip_tokenizer_init": True, "enable_memory_saver": True, "mem_fraction_static": 0.6,
        "tp_size": 2, "attention_backend": "fa3",
    }
    with pytest.raises(ValueError, match=r"options \['dtype'\]"):
        RolloutEngine(ckpt, backend="sglang", options={"dtype": "float16"})
    with pytest.raises(ValueError, match="kv_cache_bytes is for backend 'torch'"):
        RolloutEngine(ckpt, backend="sglang", kv_cache_bytes=1 << 20)


def test_generate_translates_requests_and_results(ckpt, fake_sglang):
    eng, fake = _engine(ckpt)
    requests = [
        {"id": 4, "prompt_ids": [5, 6], "sampling": {"temperature": 0.5, "top_p": 0.9, "top_k": 5,
                                                     "max_new_tokens": 6, "stop_token_ids": [9], "seed": 3}},
        {"id": 9, "prompt_ids": [2, 3, 4], "sampling": {"max_new_tokens": 5, "ignore_eos": True}},
    ]
    eng.set_weight_version(7)
    results = eng.generate(requests)
    sent = fake.calls[-1][1]
    assert sent[0] == {"temperature": 0.5, "top_p": 0.9, "top_k": 5, "max_new_tokens": 6,
                       "stop_token_ids": [9], "ignore_eos": False, "sampling_seed": 3}
    assert isinstance(sent[1]["sampling_seed"], int) and sent[1]["ignore_eos"] is True
    expected = [fake._one(ids, sp, True) for ids, sp in zip([[5, 6], [2, 3, 4]], sent)]
    for req, result, out in zip(requests, results, expected):
        assert result["id"] == req["id"] and result["weight_version"] == 7
        assert result["token_ids"] == out["output_ids"]
        assert result["logprobs"] == [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert result["finish_reason"] == out["meta_info"]["finish_reason"]["type"]
    assert results[1]["finish_reason"] == "length" and len(results[1]["token_ids"]) == 5


def test_stop_and_abort(ckpt, fake_sglang):
    eng, fake = _engine(ckpt)
    # (sum*7 + 3i) % 47 for prompt [1]: 7, 10, 13, ... -> 13 is the third token
    out = eng.generate([{"id": 0, "prompt_ids": [1], "sampling": {"max_new_tokens": 8, "stop_token_ids": [13],
                                                                  "seed": 0}}])[0]
    assert (out["token_ids"], out["finish_reason"]) == ([7, 10, 13], "stop")
    fake.abort_ids.add(1)
    with pytest.raises(RuntimeError, match="did not finish request id=0.*abort"):
        eng.generate([{"id": 0, "prompt_ids": [1], "sampling": {"max_new_tokens": 3}}])


def test_release_resume_and_weight_sync(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, dtype="bfloat16", options={"tp_size": 2})
    assert eng.release(["weights", "kv_cache"])["state"] == "released"
    assert fake.calls[-1] == ("release", ["weights", "kv_cache", "cuda_graph"])
    eng.resume(["weights"])
    assert fake.calls[-1] == ("resume", ["weights"])

    source = load_causal_lm(ckpt, "bfloat16").state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=8 * 1024)
    assert set(fake.weights) == set(source)
    for name, tensor in source.items():
        assert fake.weights[name].dtype == torch.bfloat16 and torch.equal(fake.weights[name], tensor), name
    assert all(call == ("update_weights", False) for call in fake.calls if call[0] == "update_weights")
    assert ("flush_cache",) not in fake.calls
    eng.set_weight_version(1)
    assert fake.calls[-1] == ("flush_cache",)  # once, when the update is complete

    eng.resume(["kv_cache"])
    assert fake.calls[-1] == ("resume", ["kv_cache", "cuda_graph"]) and not fake.paused
    assert eng.generate([{"id": 0, "prompt_ids": [1], "sampling": {"max_new_tokens": 2}}])[0]["weight_version"] == 1


def test_weight_bucket_checks_and_no_checksum(ckpt, fake_sglang):
    eng, fake = _engine(ckpt, dtype="bfloat16")
    cases = [
        ([("model.layers.5.mlp.up_proj.weight", torch.zeros(128, 64, dtype=torch.bfloat16))], "unknown tensor"),
        ([("model.norm.weight", torch.zeros(32, dtype=torch.bfloat16))], r"shape \[32\].*\[64\]"),
        ([("model.norm.weight", torch.zeros(64))], "dtype float32.*bfloat16"),
    ]
    for named, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.update_weights(next(pack_buckets(named, 1 << 20)))
    assert fake.weights == {}
    with pytest.raises(RuntimeError, match="needs backend 'torch'"):
        eng.weights_checksum()


def test_missing_sglang_is_a_clear_error(ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail
    with pytest.raises(ImportError, match="needs the sglang package.*backend 'torch'"):
        RolloutEngine(ckpt, backend="sglang")
