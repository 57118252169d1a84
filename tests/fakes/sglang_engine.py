"""A contract fake of sglang's in-process Engine, rebuilt from the source of sglang 0.5.21 and 0.5.23.

sglang cannot run on the test machines (it needs its CUDA kernels), so this module stands in
for the parts of it that roles/rollout/sglang_backend.py calls, failures included. Every
modelled behaviour names the file and line it copies (sglang 0.5.23 wheel, `sglang/...`;
0.5.21's line where it differs). What it copies:

- arguments: exactly the `ServerArgs` fields of the pinned wheels (sglang_server_args.json,
  written from the wheels by gen_server_args.py); anything else is msgspec's TypeError.
- the model: the engine runs the HF checkpoint at `model_path` (transformers, CPU), so its
  tokens and log-probs come from its weights: a rollout from wrong weights is visibly wrong.
- sampling: temperature 0 is greedy at T = 1 and ignores any seed; a request's
  `sampling_seed` counts only under `enable_deterministic_inference`, otherwise one generator
  seeded with `random_seed` samples every request (so a sample depends on the batch).
- memory: release/resume track sglang's tags; with `enable_memory_saver`, releasing
  "weights" without `enable_weights_cpu_backup` throws their contents away (torch_memory_saver
  unmaps the memory; resume maps new, uninitialised memory): the parameters become noise.
  Without the memory saver, release frees nothing and keeps everything.
- aborts (`abort_prompts`): a request sglang's scheduler finishes with FINISH_ABORT
  (schedule_batch.py:332-345), e.g. its out-of-memory retract (:3514-3519), comes back from a
  non-streaming `generate` as the tokenizer manager hands it on, per version
  (`_raise_for_abort`): a ValueError for status 400, a fastapi.HTTPException for 500/503
  (0.5.21) or any 401-599 (0.5.23), the whole batch lost; other statuses as an output.
- the partial rollout's abort: `Engine.loop` (the event loop `generate` runs the batch in, so a
  callback another thread queues there runs mid-call), `Engine.tokenizer_manager` with its
  `rid_to_state` (ReqState.finished) and `abort_request(abort_all=True)`: a queued request comes
  back without tokens ("Abort in waiting queue"), the running one after one more forward with
  finish_reason abort and no status (FakeTokenizerManager, `_batch`, `_waiting_abort`).
- streamed requests: `async_generate` (one prompt) on `Engine.loop`, as the adapter's stream sends
  them; the fake computes each when its task first runs.
- empty input: `generate(input_ids=[])` is io_struct.py's ValueError("input_ids cannot be empty.").
- flush_cache refused while requests are pending (`pending_requests`, scheduler.py:5518-5547).
- shutdown: `Engine.shutdown()` is recorded; its children (none here) would be killed.
- death: where sglang's scheduler raises (resuming a tag that was not released, a weight name
  the model lacks, releasing weights under the weight cache, a forward over released memory)
  the scheduler dies and takes the engine's process with it: this fake SIGKILLs its own
  process, as sglang's SIGQUIT handler does. Where sglang raises in the caller's process
  (tokenizer manager, msgspec), the fake raises the same exception.

Where it still differs from sglang (docs/architecture.md keeps this list for readers):
one process (TP ranks are loop iterations; no scheduler or detokenizer children), no
batching, KV or radix cache (each token re-runs the whole sequence; `flush_cache` only counts),
no CUDA graphs, no top-p/top-k kernels' numerics (torch on the CPU), HF parameter names
(sglang fuses q/k/v and gate/up; the loaders' narrowing is not modelled), a release while
requests run cannot happen (generate is synchronous), no memory is reported, an abort
reaches the "scheduler" at once (sglang's AbortReq travels over ZMQ while the batch decodes on)
and only abort_all is modelled, and one payload
given to two TP ranks is a RuntimeError here (in sglang it breaks torch's CUDA-IPC ref counts
later, with no error at the call).

`sglang.srt.weight_sync.tensor_bucket` imports with torch alone; when sglang is installed
(the GPU run installs it without deps) `install` uses that real module, otherwise the copy
below. `sglang.srt.utils` (MultiprocessingSerializer) pulls sglang's whole runtime (triton,
aiohttp, IPython, ...), so its serializer is copied here and the real one runs in the GPU test.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import os
import pickle
import random
import signal
import sys
import traceback
import types
import uuid
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import List, Tuple

import torch

VERSION = "0.5.23"
# For engines in role processes (write_package): JSON {call number: abort} -> the first request
# of that `generate` call (0-based, per engine) is aborted as `abort_prompts` would
ABORTS_ENV = "TANDEM_FAKE_SGLANG_ABORTS"
EOS_ID = None  # install(eos_id=...) overrides the checkpoint's eos id (sglang reads it from the HF config)

# srt/server_args.py:551-563 (0.5.21: 461-473): ServerArgs is a msgspec Struct built from the
# fields of the `_INPUT_NAMESPACES` classes (server_args.py:522-544; 0.5.21: 432-454), built in
# Engine.__init__ (srt/entrypoints/engine.py:297): an unknown keyword is a TypeError.
SERVER_ARGS = json.loads(Path(__file__).with_name("sglang_server_args.json").read_text())["versions"]
SERVER_ARGS_FIELDS = frozenset(SERVER_ARGS[VERSION]["fields"])
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
SAMPLING_EPS = 1e-6  # srt/sampling/sampling_params.py:42


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


try:  # sglang depends on fastapi; where it is absent, starlette's HTTPException stands in
    from fastapi import HTTPException
except ImportError:
    class HTTPException(Exception):
        """starlette/exceptions.py:7-20 (starlette 1.10), fastapi.HTTPException's base."""

        def __init__(self, status_code: int, detail: str | None = None, headers=None):
            self.status_code, self.detail, self.headers = status_code, detail or "", headers

        def __str__(self) -> str:
            return f"{self.status_code}: {self.detail}"

# srt/managers/schedule_batch.py:3514-3519 (0.5.21: 3360-3365): retract_decode aborts the last
# request of a decode batch that does not fit even alone
OOM_RETRACT = {"message": "Out of memory even after retracting all other requests in the decode batch. "
                          "Aborting the last request.", "status_code": 500}


def _raise_for_abort(finish_reason: dict, version: str) -> None:
    """TokenizerManager._handle_abort_finish_reason for a non-streaming call.

    0.5.23 (tokenizer_manager.py:1891-1921): an abort with a status in [400, 600) raises,
    ValueError for 400 and fastapi.HTTPException(status, message) otherwise. 0.5.21
    (:1790-1829): ValueError for 400, HTTPException only for 500 and 503. Any other abort is
    returned as an output. In a batch, _collect_batch_responses (0.5.23: :2197-2208; 0.5.21:
    :2070-) gathers
    the requests' waits: the first exception ends the call, and the batch's other results are lost.
    """
    if finish_reason.get("type") != "abort":
        return
    status = finish_reason.get("status_code")
    if status == 400:
        raise ValueError(finish_reason["message"])
    raising = (500, 503) if version == "0.5.21" else range(400, 600)
    if status in raising:
        raise HTTPException(status_code=status, detail=finish_reason["message"])


def scheduler_dies(exc: BaseException) -> None:
    """sglang's scheduler dying of `exc`, and the engine's process with it.

    srt/managers/scheduler.py:6369-6373 (0.5.21: 6089-6093): run_scheduler_process catches any
    exception of the event loop, logs it and sends SIGQUIT to its parent, the process that
    built the Engine. srt/entrypoints/engine.py:1976-1982 (0.5.21: 1871-1877) handles SIGQUIT
    with kill_process_tree(os.getpid()), which kills the children and then the process itself
    with SIGKILL (srt/utils/common.py:2548-2552). Nothing in the caller can catch it.
    """
    msg = "".join(traceback.format_exception(exc))
    print(f"[fake sglang] Scheduler hit an exception: {msg}"
          "Received sigquit from a child process. It usually means the child failed.", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class ReqState:  # srt/managers/tokenizer_manager.py:268-282 (0.5.21: 235-248), the fields used
    finished: bool = False
    abort_sent: bool = False


class FakeTokenizerManager:
    """`Engine.tokenizer_manager`: its requests' states and abort_request."""

    def __init__(self):
        self.rid_to_state: dict[str, ReqState] = {}
        self.abort_all = False  # an AbortReq(abort_all=True) the scheduler holds

    def abort_request(self, rid: str = "", abort_all: bool = False):
        """tokenizer_manager.py:2241-2265 (0.5.21: 2114-2138): an empty rid without abort_all is
        ignored, an unknown rid too (one tokenizer worker); otherwise an AbortReq goes to the
        scheduler. The fake models abort_all only (what the adapter sends)."""
        if not abort_all and not rid:
            return
        assert abort_all, "the fake models abort_request(abort_all=True) only"
        self.abort_all = True


def _waiting_abort(rid: str, return_logprob: bool) -> dict:
    """What a non-streaming generate returns for a request aborted in the scheduler's waiting queue:
    TokenizerManager._handle_abort_req (tokenizer_manager.py:3577-3643; 0.5.21: 3370-3433), no
    tokens, "Abort in waiting queue", no status (so _handle_abort_finish_reason lets it through)."""
    meta = {"id": rid, "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "completion_tokens": 0}
    if return_logprob:
        meta["output_token_logprobs"] = []
    return {"output_ids": [], "meta_info": meta}


class FakeEngine:
    """`sglang.Engine` as the adapter uses it; `calls` records each call in order."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SERVER_ARGS_FIELDS)
        if unknown:  # msgspec's error for a defstruct built without the field
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        from transformers import AutoModelForCausalLM

        self.server_args = kwargs
        self.tp_size = kwargs.get("tp_size", 1)
        self.memory_saver = kwargs.get("enable_memory_saver", False)
        self.weights_cpu_backup = kwargs.get("enable_weights_cpu_backup", False)
        dtype = kwargs.get("dtype", "auto")
        self.model = AutoModelForCausalLM.from_pretrained(
            kwargs["model_path"], dtype=getattr(torch, dtype) if dtype != "auto" else "auto").eval()
        self.eos_id = EOS_ID if EOS_ID is not None else self.model.config.eos_token_id
        # arg_groups/serving_hook.py:660-665: an unset random_seed is drawn at random;
        # scheduler.py:1261 seeds the sampler's generator with it once
        seed = kwargs.get("random_seed")
        self.generator = torch.Generator().manual_seed(seed if seed is not None else random.randint(0, 1 << 30))
        self.offload_tags: set[str] = set()
        self.session: str | None = None  # scheduler_components/weight_updater.py:81-99
        self.calls: list[tuple] = []
        self.version = VERSION  # whose abort handling generate copies (_raise_for_abort)
        # sum(prompt) -> the finish_reasons ({"message", "status_code"}) of its next tries' aborts
        self.abort_prompts: dict[int, list[dict]] = {}
        self.call_aborts = {int(k): v for k, v in json.loads(os.environ.get(ABORTS_ENV, "{}")).items()}
        self.num_generate_calls = 0
        self.pending_requests = 0  # requests the scheduler still runs: flush_cache refuses
        self.shut_down = False
        self.read_payloads: set[bytes] = set()
        self.cache_entries = 0  # requests served since the last flush (radix cache stand-in)
        self.loop = asyncio.new_event_loop()  # engine.py:396 (0.5.21: 374) _ensure_event_loop
        self.tokenizer_manager = FakeTokenizerManager()

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """The model's tensors by HF name (tied ones under both names, as in the checkpoint)."""
        return self.model.state_dict()

    # -- srt/entrypoints/engine.py:433 generate --------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                 logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None):
        """engine.py:433-545: the batch runs in the engine's event loop (run_until_complete), which
        is how a callback another thread queued there (loop.call_soon_threadsafe) runs mid-call."""
        assert prompt is None and not stream
        if len(input_ids) == 0:  # managers/io_struct.py:499 (0.5.21: 489), no session given
            raise ValueError("input_ids cannot be empty.")
        assert isinstance(input_ids[0], list)
        self.calls.append(("generate", sampling_params))
        if self.num_generate_calls in self.call_aborts:
            self.abort_prompts.setdefault(sum(input_ids[0]), []).append(self.call_aborts[self.num_generate_calls])
        self.num_generate_calls += 1
        if self.memory_saver and self.offload_tags:
            # a forward over unmapped memory is a CUDA fault inside the scheduler
            scheduler_dies(RuntimeError(f"CUDA error: an illegal memory access was encountered "
                                        f"(memory {sorted(self.offload_tags)} released)"))
        # io_struct.py GenerateReqInput: a batch without rids gets a uuid each
        rids = list(rid) if rid is not None else [uuid.uuid4().hex for _ in input_ids]
        outs = self.loop.run_until_complete(self._batch(rids, input_ids, [_verify(sp) for sp in sampling_params],
                                                        return_logprob))
        self.cache_entries += len(outs)
        for out in outs:
            _raise_for_abort(out["meta_info"]["finish_reason"], self.version)
        return outs

    async def _batch(self, rids, input_ids, sps, return_logprob):
        """The batch, one request after another (no batching here): the one running, the rest in the
        scheduler's waiting queue. _handle_batch_request (tokenizer_manager.py:2074-2160; 0.5.21: 1959-)
        makes every request's ReqState
        before it waits; a finished one's state is dropped from rid_to_state."""
        tm = self.tokenizer_manager
        for r in rids:
            tm.rid_to_state[r] = ReqState()
        outs = []
        for r, ids, sp in zip(rids, input_ids, sps):
            if tm.abort_all:  # scheduler.py:5685-5703: a queued request is popped and echoed back
                outs.append(_waiting_abort(r, return_logprob))  # tokenizer_manager.py:3577-3640
            else:
                outs.append(await self._one(ids, sp, return_logprob, r))
            tm.rid_to_state.pop(r).finished = True
        tm.abort_all = False
        return outs

    # -- engine.py async_generate: one GenerateReqInput through the tokenizer manager, awaited on
    # the caller's loop; Engine.__init__ keeps `self.loop` (asyncio's running loop, else a new
    # one set as the thread's), on which `generate` runs its requests too -------------------
    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None):
        assert prompt is None and not stream
        if len(input_ids) == 0:  # managers/io_struct.py:499 (0.5.21: 489)
            raise ValueError("input_ids cannot be empty.")
        assert isinstance(input_ids[0], int)  # one prompt: its output is a dict, not a list of them
        self.calls.append(("async_generate", sampling_params))
        if self.num_generate_calls in self.call_aborts:
            self.abort_prompts.setdefault(sum(input_ids), []).append(self.call_aborts[self.num_generate_calls])
        self.num_generate_calls += 1
        self.pending_requests += 1
        try:
            await asyncio.sleep(0)  # the scheduler works while the caller's loop runs other tasks
            if self.memory_saver and self.offload_tags:
                scheduler_dies(RuntimeError(f"CUDA error: an illegal memory access was encountered "
                                            f"(memory {sorted(self.offload_tags)} released)"))
            out = await self._one(input_ids, _verify(sampling_params), return_logprob, rid or "rid")
        finally:
            self.pending_requests -= 1
        self.cache_entries += 1
        _raise_for_abort(out["meta_info"]["finish_reason"], self.version)
        return out

    async def _one(self, ids, sp, return_logprob, rid="rid"):
        temperature, top_k, top_p = sp.get("temperature", 1.0), sp.get("top_k", -1), sp.get("top_p", 1.0)
        if 0 <= temperature < SAMPLING_EPS:  # sampling_params.py:245-248: greedy is top_k 1 at T = 1
            temperature, top_k = 1.0, 1
        deterministic = self.server_args.get("enable_deterministic_inference", False)
        # sampling_batch_info.py:157-172: the per-request seed reaches the sampler only in
        # deterministic mode; otherwise the scheduler's generator (random_seed) samples.
        generator = self.generator
        if deterministic and sp.get("sampling_seed") is not None:
            generator = torch.Generator().manual_seed(sp["sampling_seed"])
        stops = set() if sp.get("ignore_eos") else set(sp.get("stop_token_ids") or []) | {self.eos_id}
        seq, out, logprobs, finish = list(ids), [], [], None
        for _ in range(sp["max_new_tokens"]):
            with torch.no_grad():
                logits = self.model(torch.tensor([seq])).logits[0, -1].float() / temperature
            logp = torch.log_softmax(logits, -1)  # layers/sampler.py:192-198: of the scaled distribution
            if top_k == 1:  # sampler.py: argmax, no random draw
                token = int(logits.argmax())
            else:
                token = int(torch.multinomial(_filtered(logp.exp(), top_k, top_p), 1, generator=generator))
            seq.append(token), out.append(token), logprobs.append(float(logp[token]))
            if self.tokenizer_manager.abort_all:
                # scheduler.py:5796-5808 (0.5.21: 5569-5584): a running request gets to_finish =
                # FINISH_ABORT() and runs one more forward, whose token is kept
                # (batch_result_processor.py:365-369); then Req.update_finish_state
                # (schedule_batch.py:2007-2013; 0.5.21: 1919-) finishes it as aborted
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            elif len(out) >= sp["max_new_tokens"]:  # Req.update_finish_state (schedule_batch.py:2038-2046): length first
                finish = {"type": "length", "length": sp["max_new_tokens"]}  # schedule_batch.py:320-329
            elif token in stops:
                finish = {"type": "stop", "matched": token}  # schedule_batch.py:284-293
            if finish:
                break
            await asyncio.sleep(0)  # the event loop runs its callbacks between forwards
        if self.abort_prompts.get(sum(ids)):  # FINISH_ABORT.to_json, schedule_batch.py:332-345
            finish = {"type": "abort", "status_code": None, "err_type": None, **self.abort_prompts[sum(ids)].pop(0)}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out)}
        if return_logprob:  # tokenizer_manager.py:3104-3108: (logprob, token_id, None) without text
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(logprobs, out)]
        return {"output_ids": out, "meta_info": meta}  # tokenizer_manager.py:2647 (skip_tokenizer_init)

    # -- scheduler_components/weight_updater.py:337-420 (0.5.21: 318-401) release / resume -------
    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))
        tags = tags or GPU_MEMORY_ALL_TYPES  # :345-346
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self.flush_cache()  # :365, the pool is gone
        if "weights" in tags:
            if self.server_args.get("weight_cache_mode", "off") != "off":  # :368 -> :289-303
                scheduler_dies(RuntimeError("[weight_cache] release_memory_occupation of model weights "
                                            "is not supported while the weight cache is active"))
            if self.memory_saver and not self.weights_cpu_backup:
                # :373 pauses the "weights" region; load_model_utils.py:307-326 (0.5.21: 300-319)
                # made it with enable_cpu_backup=enable_weights_cpu_backup, and torch_memory_saver
                # throws the contents away without a backup (its README, "CPU Backup"). Without
                # the memory saver, pause is a no-op (utils/torch_memory_saver_adapter.py:139-165).
                self._discard_weights()

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))
        for tag in tags or GPU_MEMORY_ALL_TYPES:
            if tag not in self.offload_tags:  # :390 set.remove: KeyError inside the scheduler
                scheduler_dies(KeyError(tag))
            self.offload_tags.remove(tag)

    @torch.no_grad()
    def _discard_weights(self) -> None:
        g = torch.Generator().manual_seed(len(self.calls))
        for p in self.model.parameters():  # buffers are not weights: :369-371 stashes the static state
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))

    # -- srt/entrypoints/engine.py:1506 flush_cache; scheduler.py:5518 ----------------------
    def flush_cache(self):
        self.calls.append(("flush_cache",))
        if self.pending_requests:  # scheduler.py:5520, :5540-5547: not idle, nothing flushed
            return FlushCacheReqOutput(success=False)  # flush_wrapper.py:31 sets no message
        self.cache_entries = 0
        return FlushCacheReqOutput(success=True)

    # -- engine.py:1450-1497 (0.5.21: 1368-1413) shutdown: kills the engine's children, waits for the
    # scheduler to release its GPU context ---------------------------------------------------
    def shutdown(self):
        self.calls.append(("shutdown",))
        self.shut_down = True

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

    # -- engine.py:1679-1700 update_weights_from_tensor ----------------------------------------
    @torch.no_grad()
    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights", load_format, flush_cache))
        assert load_format == "flattened_bucket", load_format  # the only format the adapter sends
        # tokenizer_control_mixin.py:568-570 (0.5.21: 565-567, which lets dp attention through):
        # raised in the caller's process (the Engine's event loop), before anything is sent
        assert self.server_args.get("dp_size", 1) == 1, \
            "data-parallel replicas are not supported for update weights from tensor"
        # engine.py:1750-1753: flattened_bucket payloads are pre-serialized, one per TP rank
        payloads = [normalize_serialized_named_tensor_payload(p) for p in named_tensors]
        if self.session is None:  # weight_updater.py:234-239
            return False, ("update_weights_from_tensor must run between begin_weight_update() "
                           "and end_weight_update()")
        # weight_updater.py:240-243 -> tp_worker.py:194-201: each rank deserializes only
        # payloads[tp_rank], in its scheduler, outside any try: a missing payload, or one that
        # does not unpickle or that sglang's SafeUnpickler blocks, kills the scheduler
        if len(payloads) < self.tp_size:
            scheduler_dies(IndexError("list index out of range"))
        params = self.model.state_dict()
        for rank in range(self.tp_size):
            data = payloads[rank]
            if data in self.read_payloads:  # one share read twice: torch's IPC refcount breaks
                raise RuntimeError(f"fake sglang: TP rank {rank} got a payload that was already read")
            self.read_payloads.add(data)
            try:
                bucket = MultiprocessingSerializer.deserialize(data)
            except Exception as exc:
                scheduler_dies(exc)
            tb = _tensor_bucket()
            # model_runner_components/weight_updater.py:383-412
            meta = [tb.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                               end_idx=m.end_idx, numel=m.numel) for m in bucket["metadata"]]
            for name, tensor in tb.FlattenedTensorBucket(flattened_tensor=bucket["flattened_tensor"],
                                                         metadata=meta).reconstruct_tensors():
                if name not in params:  # models/qwen3.py:744 params_dict[name], in the scheduler
                    scheduler_dies(KeyError(name))
                if rank == 0:  # model.load_weights copies into the parameters
                    params[name].copy_(tensor)
        if flush_cache:  # weight_updater.py:120-133
            self.flush_cache()
        return True, "Success"


def _filtered(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The probabilities top-k then top-p keep (sampler.py's top_k_top_p renormalisation)."""
    if 0 < top_k < probs.numel():
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p * sorted_p.sum()
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
    return probs / probs.sum()


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


def install(monkeypatch, eos_id: int | None = None) -> type[FakeEngine]:
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
    if HTTPException.__module__ == __name__:  # no fastapi here: the adapter imports the stand-in
        mods["fastapi"] = types.ModuleType("fastapi")
        mods["fastapi"].HTTPException = HTTPException
    for name, mod in mods.items():
        monkeypatch.setitem(__import__("sys").modules, name, mod)
    from importlib import metadata

    real_version = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: VERSION if d == "sglang" else real_version(d))
    return Engine


def write_package(root: Path) -> Path:
    """An importable `sglang` under `root` that is this fake, with the dist-info of VERSION, for
    role processes (the supervisor's children inherit the driver's sys.path): put `root` first
    on sys.path. Returns `root`."""
    files = {
        "sglang/__init__.py": "from tests.fakes.sglang_engine import FakeEngine as Engine, VERSION as __version__\n",
        "sglang/srt/__init__.py": "",
        "sglang/srt/utils/__init__.py": "from tests.fakes.sglang_engine import MultiprocessingSerializer\n",
        "sglang/srt/utils/patch_torch.py": "from tests.fakes.sglang_engine import monkey_patch_torch_reductions\n",
        "sglang/srt/weight_sync/__init__.py": "",
        "sglang/srt/weight_sync/tensor_bucket.py":
            "from tests.fakes.sglang_engine import FlattenedTensorBucket, FlattenedTensorMetadata\n",
        f"sglang-{VERSION}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: sglang\nVersion: {VERSION}\n",
    }
    if HTTPException.__module__ == __name__:  # no fastapi here: the stand-in, as `install` does
        files["fastapi/__init__.py"] = "from tests.fakes.sglang_engine import HTTPException\n"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


# The copy lives under the real module's name: pickles of its metadata must name the module
# sglang's allow-list names.
_COPY_MODULE = types.ModuleType("sglang.srt.weight_sync.tensor_bucket")
_COPY_MODULE.FlattenedTensorMetadata = FlattenedTensorMetadata
_COPY_MODULE.FlattenedTensorBucket = FlattenedTensorBucket
FlattenedTensorMetadata.__module__ = FlattenedTensorBucket.__module__ = _COPY_MODULE.__name__
