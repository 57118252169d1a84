"""A contract fake of sglang's in-process Engine, rebuilt from the source of sglang 0.5.23.

sglang cannot run on the test machines (it needs its CUDA kernels), so this module stands in
for the parts of it that roles/rollout/sglang_backend.py calls. Every modelled behaviour
names the file and line (sglang 0.5.23 wheel, `python/sglang/...`) it copies; 0.5.21 reads
the same at each of them. What it does NOT model: the model itself (tokens come from a
fixed formula, log-probs are made up), batching, CUDA graphs, memory (release/resume only
track tags), TP ranks as processes (ranks are loop iterations in one process).

`sglang.srt.weight_sync.tensor_bucket` imports with torch alone; when sglang is installed
(the GPU run installs it without deps) `install` uses that real module, otherwise the copy
below. `sglang.srt.utils` (MultiprocessingSerializer) pulls sglang's whole runtime (triton,
aiohttp, IPython, ...), so its serializer is copied here and the real one runs in the GPU test.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import List, Tuple

import torch

VERSION = "0.5.23"
EOS_ID = None  # set by install(): the tiny model's eos id, which sglang reads from the HF config

# ServerArgs fields the adapter and the tests pass; sglang accepts ~600 more. ServerArgs is a
# msgspec Struct (srt/server_args.py:551 `msgspec.defstruct`), built in Engine.__init__
# (srt/entrypoints/engine.py:297), so an unknown keyword is a TypeError at construction.
SERVER_ARGS_FIELDS = {
    "model_path": "srt/arg_groups/fields/model.py:51",
    "dtype": "srt/arg_groups/fields/model.py:160",
    "random_seed": "srt/arg_groups/fields/device.py:47",
    "base_gpu_id": "srt/arg_groups/fields/device.py:28",
    "mem_fraction_static": "srt/arg_groups/fields/schedule.py:27",
    "max_running_requests": "srt/arg_groups/fields/schedule.py:31",
    "skip_tokenizer_init": "srt/arg_groups/fields/serving.py:58",
    "enable_memory_saver": "srt/arg_groups/fields/exec_.py:58",
    "disable_cuda_graph": "srt/arg_groups/fields/exec_.py:670",
    "enable_deterministic_inference": "srt/arg_groups/fields/exec_.py:1153",
    "tp_size": "srt/arg_groups/fields/parallel.py:45",
    "log_level": "srt/arg_groups/fields/observability.py:31",
    "attention_backend": "srt/arg_groups/fields/exec_.py:207",
}
# srt/sampling/sampling_params.py:140-200: SamplingParams is a msgspec Struct (kw_only): an
# unknown keyword is a TypeError. Its public fields:
SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "beam_width", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
    "custom_params", "watermark",
}
GPU_MEMORY_ALL_TYPES = ["kv_cache", "weights", "cuda_graph"]  # srt/constants.py:2-10
VOCAB = 47


# -- srt/weight_sync/tensor_bucket.py:7-16, 19-84, 114-132 (copy; used when sglang is absent) ---
@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    supports_multi_dtypes = True

    def __init__(self, named_tensors: List[Tuple[str, torch.Tensor]] = None,
                 flattened_tensor: torch.Tensor = None, metadata: List[FlattenedTensorMetadata] = None):
        if named_tensors is not None:  # bytes of each tensor, concatenated; offsets in bytes
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            self.metadata, parts, idx = [], [], 0
            for name, tensor in named_tensors:
                flat = tensor.flatten().view(torch.uint8)
                self.metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, idx,
                                                             idx + flat.numel(), flat.numel()))
                parts.append(flat)
                idx += flat.numel()
            self.flattened_tensor = torch.cat(parts, dim=0)
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("Must provide either named_tensors or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> List[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> List[Tuple[str, torch.Tensor]]:
        return [(m.name, self.flattened_tensor[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape))
                for m in self.metadata]


try:  # the real module, when sglang is installed: it needs nothing but torch
    from sglang.srt.weight_sync import tensor_bucket as _real_tensor_bucket
except ImportError:
    _real_tensor_bucket = None


# -- srt/utils/common.py:3060-3101 MultiprocessingSerializer, 3144-3370 SafeUnpickler ---------
class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj, output_str: bool = False):
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)  # CUDA tensors go as IPC handles, CPU ones through shm fds
        out = buf.getvalue()
        return base64.b64encode(out).decode("utf-8") if output_str else out

    @staticmethod
    def deserialize(data):
        if isinstance(data, str):
            data = base64.b64decode(data, validate=True)
        return _SafeUnpickler(io.BytesIO(data)).load()


class _SafeUnpickler(pickle.Unpickler):
    """The subset of sglang's allow-list (common.py:3148-3359) a weight payload can touch;
    anything else is refused with sglang's message (common.py:3369)."""

    ALLOWED = {("builtins", n) for n in ("bool", "bytes", "dict", "float", "int", "list", "str", "tuple")} | {
        ("collections", "OrderedDict"), ("copyreg", "__newobj__"),
        ("multiprocessing.resource_sharer", "DupFd"), ("torch", "Size"), ("torch", "Tensor"),
        ("torch", "device"), ("torch", "dtype"),
        ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"), ("torch", "UntypedStorage"),
        ("torch._utils", "_rebuild_tensor_v2"), ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
    } | {("torch", n) for n in ("bfloat16", "float16", "float32", "uint8", "int64")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def normalize_serialized_named_tensor_payload(data) -> bytes:  # srt/utils/common.py:3109-3126
    if isinstance(data, str):
        return base64.b64decode(data, validate=True)
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = bytes(data)
        if len(data) >= 2 and data[0] == 0x80 and data[1] <= pickle.HIGHEST_PROTOCOL:
            return data
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            return data
    raise TypeError("serialized_named_tensors entries must be base64 strings or bytes-like "
                    f"payloads, got {type(data).__name__}")


def monkey_patch_torch_reductions():
    """srt/utils/patch_torch.py:41: names CUDA devices by UUID in IPC handles; nothing to do on CPU."""


@dataclass
class FlushCacheReqOutput:  # srt/managers/io_struct.py:1859
    success: bool
    message: str = ""


class FakeEngine:
    """`sglang.Engine` as the adapter uses it; `calls` records each call in order."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(SERVER_ARGS_FIELDS))
        if unknown:  # msgspec's error for a defstruct built without the field
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        self.server_args = kwargs
        self.tp_size = kwargs.get("tp_size", 1)
        self.offload_tags: set[str] = set()
        self.session: str | None = None  # scheduler_components/weight_updater.py:81-99
        self.weights: dict[str, torch.Tensor] = {}
        self.calls: list[tuple] = []
        self.abort_prompts: dict[int, dict] = {}  # sum(prompt) -> finish_reason of an abort
        self.read_payloads: set[bytes] = set()
        self.cache_entries = 0  # requests served since the last flush (radix cache stand-in)

    # -- srt/entrypoints/engine.py:433 generate --------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None):
        assert prompt is None and isinstance(input_ids[0], list) and not stream
        self.calls.append(("generate", sampling_params))
        if self.offload_tags:  # generating into released memory is a CUDA fault, not an error
            raise RuntimeError(f"fake sglang: generate with released memory {sorted(self.offload_tags)}")
        outs = [self._one(ids, _verify(sp), return_logprob) for ids, sp in zip(input_ids, sampling_params)]
        for out in outs:
            # tokenizer_manager.py:1900-1921: an abort with a 400 status raises ValueError for a
            # non-streaming call; one without a status comes back as an output.
            reason = out["meta_info"]["finish_reason"]
            if reason["type"] == "abort" and reason.get("status_code") == 400:
                raise ValueError(reason["message"])
        self.cache_entries += len(outs)
        return outs

    def _one(self, ids, sp, return_logprob):
        deterministic = self.server_args.get("enable_deterministic_inference", False)
        # sampling_batch_info.py:157-172: the per-request seed reaches the sampler only in
        # deterministic mode; otherwise the scheduler's generator (random_seed) samples.
        seed = sp.get("sampling_seed") if deterministic else self.server_args.get("random_seed")
        out, finish = [], None
        for i in range(sp["max_new_tokens"]):
            out.append((sum(ids) * 7 + 3 * i + (seed or 0)) % VOCAB)
            if len(out) >= sp["max_new_tokens"]:  # Req.update_finish_state (schedule_batch.py:2038-2046): length first
                finish = {"type": "length", "length": sp["max_new_tokens"]}  # schedule_batch.py:320-329
            elif not sp.get("ignore_eos") and out[-1] in set(sp.get("stop_token_ids") or []) | {EOS_ID}:
                finish = {"type": "stop", "matched": out[-1]}  # schedule_batch.py:284-293
            if finish:
                break
        if sum(ids) in self.abort_prompts:  # schedule_batch.py:332-345
            finish = {"type": "abort", "status_code": None, "err_type": None, **self.abort_prompts[sum(ids)]}
        meta = {"id": "rid", "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out)}
        if return_logprob:  # tokenizer_manager.py:3104-3108: (logprob, token_id, None) without text
            meta["output_token_logprobs"] = [(-(i + 1) / 10, t, None) for i, t in enumerate(out)]
        return {"output_ids": out, "meta_info": meta}  # tokenizer_manager.py:2647 (skip_tokenizer_init)

    # -- scheduler_components/weight_updater.py:337-420 release / resume -------------------
    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))
        tags = tags or GPU_MEMORY_ALL_TYPES
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self.flush_cache()  # :365, the pool is gone

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))
        for tag in tags or GPU_MEMORY_ALL_TYPES:
            self.offload_tags.remove(tag)  # :390: KeyError for a tag that was not released

    # -- srt/entrypoints/engine.py:1506 flush_cache; scheduler.py:5518 ----------------------
    def flush_cache(self):
        self.calls.append(("flush_cache",))
        self.cache_entries = 0
        return FlushCacheReqOutput(success=True)

    # -- engine.py:1643-1655 begin/end; weight_updater.py:309-335 -----------------------------
    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update",))
        if self.session is not None:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = selector
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update",))
        if self.session is None:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = None
        return True, "Success"

    # -- engine.py:1679-1760 update_weights_from_tensor ----------------------------------------
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights", load_format, flush_cache))
        assert load_format == "flattened_bucket", load_format  # the only format the adapter sends
        # engine.py:1750-1753: flattened_bucket payloads are pre-serialized, one per TP rank
        payloads = [normalize_serialized_named_tensor_payload(p) for p in named_tensors]
        if self.session is None:  # weight_updater.py:234-239
            return False, ("update_weights_from_tensor must run between begin_weight_update() "
                           "and end_weight_update()")
        if len(payloads) != self.tp_size:  # tp_worker.py:194-201 indexes payloads[tp_rank]
            raise IndexError(f"{len(payloads)} payloads for tp_size={self.tp_size}")
        for rank, data in enumerate(payloads):  # each rank deserializes only its own payload
            if data in self.read_payloads:  # one share read twice: torch's IPC refcount breaks
                raise RuntimeError(f"fake sglang: TP rank {rank} got a payload that was already read")
            self.read_payloads.add(data)
            bucket = MultiprocessingSerializer.deserialize(data)
            tb = _tensor_bucket()
            # model_runner_components/weight_updater.py:383-412
            meta = [tb.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                               end_idx=m.end_idx, numel=m.numel) for m in bucket["metadata"]]
            for name, tensor in tb.FlattenedTensorBucket(flattened_tensor=bucket["flattened_tensor"],
                                                         metadata=meta).reconstruct_tensors():
                if rank == 0:  # model.load_weights copies into the parameters
                    self.weights[name] = tensor.clone()
        if flush_cache:  # weight_updater.py:120-133
            self.flush_cache()
        return True, "Success"


def _verify(sp: dict) -> dict:
    """srt/sampling/sampling_params.py: SamplingParams(**sp) then verify() (:252-311)."""
    unknown = set(sp) - SAMPLING_KEYS
    if unknown:
        raise TypeError(f"Unexpected keyword argument '{sorted(unknown)[0]}'")
    if not 0.0 < sp.get("top_p", 1.0) <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {sp['top_p']}.")
    top_k = sp.get("top_k", -1)
    if top_k != -1 and top_k < 1:  # :249 maps -1 to the whole vocabulary before :263
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    seed = sp.get("sampling_seed")
    if seed is not None and (not isinstance(seed, int) or not -(2**63) <= seed <= 2**63 - 1):
        raise ValueError(f"sampling_seed must be an integer in [-2**63, 2**63 - 1], got {seed}.")
    return sp


def _tensor_bucket():
    return _real_tensor_bucket if _real_tensor_bucket is not None else _COPY


_COPY = types.SimpleNamespace(FlattenedTensorMetadata=FlattenedTensorMetadata,
                              FlattenedTensorBucket=FlattenedTensorBucket)


def install(monkeypatch, eos_id: int) -> type[FakeEngine]:
    """Put the fake in sys.modules as `sglang` (and report VERSION as its installed version)."""
    global EOS_ID
    EOS_ID = eos_id

    class Engine(FakeEngine):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            Engine.instances.append(self)

    Engine.instances = []
    tb = _tensor_bucket()
    names = ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.patch_torch",
             "sglang.srt.weight_sync"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["sglang"].Engine = Engine
    mods["sglang"].__version__ = VERSION
    mods["sglang.srt.utils"].MultiprocessingSerializer = MultiprocessingSerializer
    mods["sglang.srt.utils.patch_torch"].monkey_patch_torch_reductions = monkey_patch_torch_reductions
    mods["sglang.srt.weight_sync.tensor_bucket"] = tb if tb is not _COPY else _COPY_MODULE
    for name, mod in mods.items():
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    from importlib import metadata

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: VERSION if d == "sglang" else real_version(d))
    return Engine


# The copy lives under the real module's name: pickles of its metadata must name the module
# sglang's allow-list names.
_COPY_MODULE = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
_COPY_MODULE.FlattenedTensorMetadata = FlattenedTensorMetadata
_COPY_MODULE.FlattenedTensorBucket = FlattenedTensorBucket
FlattenedTensorMetadata.__module__ = FlattenedTensorBucket.__module__ = _COPY_MODULE.__name__
