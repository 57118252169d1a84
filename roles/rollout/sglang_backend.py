"""The production rollout backend: an adapter over sglang's in-process `sglang.Engine`.

Pinned to SGLANG_VERSIONS (pyproject's `sglang` extra). Each call below was read in the
source of 0.5.21 and 0.5.23 (line numbers are 0.5.23's), which agree on all of them but one:
0.5.21 lets `update_weights_from_tensor` through with dp_size > 1 under dp attention, 0.5.23
does not, so both are refused here. tests/fakes/sglang_engine.py models each call, failures
included, with the file and line each behaviour copies.

- start: `Engine(**kwargs)`; kwargs are `ServerArgs` fields (sglang rejects others).
  `skip_tokenizer_init=True`: we speak token ids only.
- generate: `Engine.generate(input_ids=[...], sampling_params=[...], return_logprob=True)`;
  a result is `output_ids` plus `meta_info["output_token_logprobs"]` ((logprob, token_id,
  None) tuples) and `meta_info["finish_reason"]` ({"type": "stop" | "length" | "abort"}).
  Log-probs are of the temperature-scaled distribution, as the torch backend's (sglang's
  layers/sampler.py:192-198; a greedy request runs at T = 1, sampling_params.py:245-248).
- seeds: sglang ignores a request's `sampling_seed` unless the engine runs with
  `enable_deterministic_inference=True` (sampling_batch_info.py:157-172 builds the seed
  tensor only then; the mode forces the pytorch sampler and batch-invariant kernels,
  arg_groups/overrides.py:1030-1035). Without it, samples come from the scheduler's
  generator seeded once by `random_seed`, so a request's sample depends on the batch it
  ran in. The seed is therefore sent only in that mode.
- release/resume: `release_memory_occupation(tags)` / `resume_memory_occupation(tags)`;
  they need `enable_memory_saver=True` (else sglang's memory-saver adapter is a no-op and
  they free nothing: utils/torch_memory_saver_adapter.py:139-165). Our "kv_cache" also
  covers sglang's "cuda_graph" buffers, as miles' offload and onload_kv do. Releasing
  "weights" throws their contents away unless the engine runs with
  `enable_weights_cpu_backup` (load_model_utils.py:307-326 makes the weights' memory-saver
  region with that backup flag; torch_memory_saver discards a region without backup): after
  such a resume the engine refuses to generate until every checkpoint tensor is loaded again. The
  driver pushes the actor's weights after every resume instead of keeping a CPU copy
  (docs/architecture.md, "sglang weights across a release"). Resuming a tag that is not
  released, or releasing while requests run, kills sglang's scheduler and this process
  (weight_updater.py:339, :390; scheduler.py:6369-6373): RolloutEngine tracks what is
  released and calls both only between `generate` calls.
- refused options: `dp_size` > 1 (update_weights_from_tensor asserts one DP replica in the
  caller's process, tokenizer_control_mixin.py:569, after the session is open) and a
  `weight_cache_mode` other than "off" (a release of the weights raises in the scheduler,
  weight_updater.py:289-303, which kills it). Both are ValueErrors before the Engine starts.
- weights: one update is `flush_cache()`, `begin_weight_update()`, one
  `update_weights_from_tensor(load_format="flattened_bucket")` per bucket, then
  `end_weight_update()` (sglang >= 0.5.21 rejects updates outside that session), the order
  miles uses. Each TP rank gets its own serialized payload (sglang's tp_worker deserializes
  only `payloads[tp_rank]`; a payload read twice breaks torch's CUDA-IPC refcounts).
  Failures: `flush_cache` refused (requests still running: success False) is a RuntimeError
  before the session opens; a refused bucket (success False: outside a session, or the model
  runner's weight-cache error, model_runner_components/weight_updater.py:348-350) is a
  RuntimeError with the session left open, so the next bucket of a retried sync continues it;
  a payload the scheduler cannot read (too few for the TP ranks, not a pickle, a global its
  SafeUnpickler blocks) or a tensor name the model lacks (models/qwen3.py:744) kills the
  scheduler and this process, so names, shapes and dtypes are checked against the checkpoint
  before anything is sent.
- aborts: a request sglang aborts (its scheduler's FINISH_ABORT, schedule_batch.py:332-345,
  e.g. out of memory even after retracting the rest of a decode batch, :3514-3519) reaches a
  non-streaming `generate` through TokenizerManager._handle_abort_finish_reason
  (tokenizer_manager.py:1891-1921; 0.5.21: 1790-1829): status 400 raises ValueError; 500 and
  503 (0.5.21) or any 401-599 (0.5.23) raise fastapi.HTTPException; any other comes back as an
  output whose finish_reason is "abort". A raise ends the whole batched call, its other results
  lost (_collect_batch_responses gathers the requests, :2197-2208), and names no request. So a
  raise aborts every request of the call, a returned abort only its own; either way
  RequestsAborted carries the finished results, and RolloutEngine issues the aborted requests
  again with their seeds (roles/rollout/aborts.py). sglang's own request validation raises
  ValueError too; the requests reaching it are validated first (sampling.py), and a request
  that keeps failing stops the call after the bounded tries, naming it.
- partial rollouts: the driver's abort board (roles/rollout/abort_board.py) is watched beside
  the call (BoardWatch): each request goes with a rid of ours, finishes are read from the
  tokenizer manager's ReqState.finished, and the abort is `tokenizer_manager.abort_request(
  abort_all=True)` (tokenizer_manager.py:2241-2265; 0.5.21: 2114-2138), run on the engine's own
  event loop. sglang returns every request it held: queued ones without tokens, running ones
  with their tokens so far and one more, finish_reason "abort" with no status, so not raised
  (docs/partial_rollouts.md, "sglang", has the lines).
- no requests: not sent (sglang raises ValueError("input_ids cannot be empty."), io_struct.py:499).
- streamed generation (RolloutEngine.stream): each request is its own `Engine.async_generate(input_ids=ids,
  sampling_params=..., return_logprob=True)` (one prompt), a task on the Engine's own event loop
  (`Engine.loop`, set in `Engine.__init__` from asyncio's running or a new loop; `generate` runs
  its requests on the same loop with `run_until_complete`). sglang's scheduler process batches
  every request in flight, so a turn sent while others decode joins their batch, and its radix
  cache finds the turn's earlier tokens by the token ids themselves: `input_ids` is all it needs
  (no session or rid). Between calls the loop is idle but the scheduler keeps decoding; the
  answers wait on the tokenizer manager's socket. A raise from one request's task (the aborts
  above) names that request alone. Dropping a stream waits for its requests to end (sglang has
  no cancel for a non-streaming request short of abort_request, and releasing memory while
  requests run kills its scheduler).
- pause/continue generation: not needed. Updates reach this actor only between `generate`
  calls (one message at a time), so sglang is idle when its weights change.
- shutdown: RolloutEngine.on_stop calls `Engine.shutdown()` when the role is stopped (SIGTERM),
  within a timeout; what is left (its scheduler, detokenizer) is in the role's session, which
  the role and then the supervisor kill (runtime/process.py).

sglang is imported lazily: only this backend needs it, and only on a GPU machine.
"""

from __future__ import annotations

import asyncio
import glob
import os
import threading
import uuid
from importlib import metadata
from types import SimpleNamespace

import torch

from roles.device import DeviceMemory
from roles.rollout.abort_board import AbortBoard
from roles.model_spec import ModelSpec
from roles.rollout.aborts import RequestsAborted
from roles.rollout.sampling import GenerateRequest
from roles.weight_sync import dtype_name, unpack_bucket
from roles.weight_views import LazyReshape, copy_into

SGLANG_VERSIONS = ">=0.5.21,<0.5.24"  # keep equal to pyproject's `sglang` extra
# Engine arguments RolloutEngine sets itself; passing them in `options` would be ambiguous.
RESERVED_OPTIONS = frozenset({
    "model_path", "dtype", "random_seed", "mem_fraction_static", "max_running_requests",
    "skip_tokenizer_init",
})
SGLANG_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}
# Engine options our weight updates cannot work with: name -> (accepted values, why not).
# ppo/config/validate.py refuses the recipe flags that would set them (--sglang-dp-size).
REFUSED_OPTIONS = {
    "dp_size": ((1, None), "sglang refuses update_weights_from_tensor with more than one data-parallel "
                "replica (an AssertionError after the update session opened, tokenizer_control_mixin.py:569)"),
    "weight_cache_mode": (("off", None), "sglang's scheduler dies releasing weights shared with the weight "
                          "cache daemon (scheduler_components/weight_updater.py:289-303), and a colocated "
                          "engine releases them every step"),
}


def sglang_problem() -> str | None:
    """Why backend 'sglang' cannot start here (not installed, wrong version), or None.

    Reads the installed version only: importing sglang itself takes seconds and a GPU stack.
    """
    from packaging.specifiers import SpecifierSet

    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ("rollout backend 'sglang' needs the sglang package, which is not installed here; "
                f"install it on the GPU machine (pip install 'sglang{SGLANG_VERSIONS}', or "
                "pip install '.[sglang]') or use --rollout-backend torch")
    if version not in SpecifierSet(SGLANG_VERSIONS):
        return (f"rollout backend 'sglang' is tested with sglang{SGLANG_VERSIONS}, but {version} is "
                f"installed; pip install 'sglang{SGLANG_VERSIONS}' (pip install '.[sglang]')")
    return None


def import_sglang() -> SimpleNamespace:
    """The sglang names the adapter uses, or an ImportError saying what to do."""
    try:
        import sglang
        from fastapi import HTTPException  # a dependency of sglang: how its aborts reach us
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as e:
        raise ImportError(
            "rollout backend 'sglang' needs the sglang package, which is not importable here "
            f"({e}); install it on the GPU machine (pip install 'sglang{SGLANG_VERSIONS}') or use "
            "backend 'torch'"
        ) from e
    return SimpleNamespace(
        Engine=sglang.Engine,
        HTTPException=HTTPException,
        MultiprocessingSerializer=MultiprocessingSerializer,
        FlattenedTensorMetadata=FlattenedTensorMetadata,
        monkey_patch_torch_reductions=monkey_patch_torch_reductions,
    )


def checkpoint_tensor_specs(hf_checkpoint: str) -> dict[str, list[int]]:
    """HF tensor name -> shape, read from the checkpoint's safetensors headers (no data)."""
    from safetensors import safe_open

    specs: dict[str, list[int]] = {}
    for path in sorted(glob.glob(os.path.join(hf_checkpoint, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                specs[name] = list(f.get_slice(name).get_shape())
    if not specs:
        raise ValueError(f"hf_checkpoint={hf_checkpoint!r} holds no *.safetensors weights")
    # a tied lm_head is saved once; trainers may still send both names
    if ModelSpec.from_checkpoint(hf_checkpoint).tied_embeddings and "lm_head.weight" not in specs:
        specs["lm_head.weight"] = specs["model.embed_tokens.weight"]
    return specs


def engine_kwargs(hf_checkpoint: str, *, dtype: str, seed: int, max_batch_size: int,
                  mem_fraction: float | None, options: dict) -> dict:
    """`sglang.Engine` keyword arguments (ServerArgs fields) for RolloutEngine's settings."""
    clash = sorted(RESERVED_OPTIONS & set(options))
    if clash:
        raise ValueError(f"backend 'sglang': options {clash} are set by RolloutEngine's own "
                         "arguments (dtype, seed, mem_fraction, max_batch_size); remove them")
    for name, (accepted, why) in REFUSED_OPTIONS.items():
        if name in options and options[name] not in accepted:
            raise ValueError(f"backend 'sglang': options {{'{name}': {options[name]!r}}} cannot work: {why}; "
                             f"leave it at {accepted[0]!r}")
    kwargs = dict(model_path=hf_checkpoint, dtype=dtype, random_seed=seed,
                  max_running_requests=max_batch_size, skip_tokenizer_init=True, **options)
    if mem_fraction is not None:
        kwargs["mem_fraction_static"] = mem_fraction
    return kwargs


def flattened_bucket_payloads(named: list[tuple[str, torch.Tensor | LazyReshape]], flat: torch.Tensor, *,
                              num_ranks: int, sgl: SimpleNamespace, device: torch.device | None,
                              owned: bool = False) -> list[str]:
    """sglang's `flattened_bucket` payloads of one bucket, one per TP rank.

    The payload holds a tensor this process allocated: a bucket mapped from the trainer over
    CUDA IPC cannot be shared again (torch: "Attempted to send CUDA tensor received from
    another process"), so it is cloned on its GPU; a CPU bucket is copied to `device` (the
    engine's first GPU) so sglang's scheduler loads from device memory; with no `device`
    (CPU tests) it goes as is. The clone costs one device-to-device copy of the bucket and
    the bucket's bytes until sglang has loaded it. Each rank's payload is serialized
    separately, so each holds its own CUDA-IPC reference.

    The layout is `FlattenedTensorBucket(named_tensors=...)`'s: bytes (uint8) with byte
    offsets, which its `reconstruct_tensors` views back as each tensor's dtype. `owned`: a
    CUDA `flat` this process allocated (a direct bucket's views gathered, `direct_groups`)
    goes as is. `named` gives each tensor's HF name, shape and dtype (what sglang's loaders
    take: QKVParallelLinear.weight_loader narrows its parameter to a q/k/v shard and copies an
    HF-shaped q_proj/k_proj/v_proj in); `flat` holds their elements in HF row-major order.
    """
    if owned:
        own = flat
    elif flat.is_cuda:
        own = flat.clone()
    elif device is not None:
        own = flat.to(device)
    else:
        own = flat
    own = own.view(torch.uint8)
    metadata_, start = [], 0
    for name, tensor in named:
        nbytes = tensor.nbytes
        metadata_.append(sgl.FlattenedTensorMetadata(
            name=name, shape=tensor.shape, dtype=tensor.dtype,
            start_idx=start, end_idx=start + nbytes, numel=nbytes))
        start += nbytes
    if own.is_cuda:
        sgl.monkey_patch_torch_reductions()  # GPU named by UUID, as sglang's receivers expect
        torch.cuda.current_stream(own.device).synchronize()  # the copy lands before any rank reads
    return [sgl.MultiprocessingSerializer.serialize({"flattened_tensor": own, "metadata": metadata_},
                                                    output_str=True)
            for _ in range(num_ranks)]


# sglang loads flat buckets: a direct bucket (roles.weight_sync; all windows of a dtype, up to
# the whole model) is gathered here in parts of at most this many bytes, so the engine's extra
# memory stays what a packed bucket of the default --update-weight-buffer-size costs it.
DIRECT_GROUP_BYTES = 512 << 20


def direct_groups(named: list[tuple[str, torch.Tensor | LazyReshape]], max_bytes: int):
    """(part, flat, owned=True) per run of a direct bucket's views of at most `max_bytes`
    (a lone larger tensor alone): `flat` gathers the part's views in one new tensor (one
    device copy, as the clone of a packed bucket), made one part at a time. A q/k/v window
    (LazyReshape) lands in HF row-major order: its metadata names the HF shape, which
    sglang's loaders need."""
    part, nbytes = [], 0
    for name, tensor in named:
        if part and nbytes + tensor.nbytes > max_bytes:
            yield part, _gathered(part), True
            part, nbytes = [], 0
        part.append((name, tensor))
        nbytes += tensor.nbytes
    if part:
        yield part, _gathered(part), True


def _gathered(part: list[tuple[str, torch.Tensor | LazyReshape]]) -> torch.Tensor:
    """A new 1-D tensor of the part's elements, tensor after tensor, in one batched copy."""
    first = part[0][1]
    flat = torch.empty(sum(t.nbytes for _, t in part) // first.dtype.itemsize, dtype=first.dtype, device=first.device)
    targets, offset = [], 0
    for _, tensor in part:
        numel = tensor.nbytes // first.dtype.itemsize
        targets.append(flat[offset : offset + numel].view(tensor.shape))
        offset += numel
    copy_into(targets, [t for _, t in part])
    return flat


class SglangBackend:
    def __init__(
        self,
        hf_checkpoint: str,
        *,
        memory: DeviceMemory,
        dtype: str,
        seed: int,
        max_batch_size: int,
        kv_cache_bytes: int | None,
        mem_fraction: float | None,
        options: dict,
    ):
        if kv_cache_bytes is not None:
            raise ValueError("backend 'sglang' sizes its KV cache with mem_fraction "
                             "(sglang's mem_fraction_static); kv_cache_bytes is for backend 'torch'")
        kwargs = engine_kwargs(hf_checkpoint, dtype=dtype, seed=seed, max_batch_size=max_batch_size,
                               mem_fraction=mem_fraction, options=options)
        self.sgl = import_sglang()
        self.memory = memory
        self.dtype = dtype
        self.tp_size = options.get("tp_size", 1)
        self.memory_saver = bool(options.get("enable_memory_saver", False))
        self.deterministic = bool(options.get("enable_deterministic_inference", False))
        self.cpu_backup = bool(options.get("enable_weights_cpu_backup", False))
        self.specs = checkpoint_tensor_specs(hf_checkpoint)
        # a tied lm_head is the embedding
        tied = ModelSpec.from_checkpoint(hf_checkpoint).tied_embeddings
        self._aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        self.engine = self.sgl.Engine(**kwargs)
        self._updating = False  # inside begin_weight_update() ... end_weight_update()
        # Tensors whose contents sglang threw away at a release without a CPU backup, not
        # loaded since; generate refuses until an update has loaded them all and ended.
        self._discarded: set[str] = set()
        self._streaming: dict[int, tuple[GenerateRequest, asyncio.Task]] = {}  # id -> (request, its task)

    # -- memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        self._check_memory_saver("release")
        self.engine.release_memory_occupation(tags=[t for tag in tags for t in SGLANG_TAGS[tag]])
        if "weights" in tags and not self.cpu_backup:
            self._discarded = {self._aliases.get(name, name) for name in self.specs}

    def resume(self, tags: list[str]) -> None:
        self._check_memory_saver("resume")
        self.engine.resume_memory_occupation(tags=[t for tag in tags for t in SGLANG_TAGS[tag]])

    def _check_memory_saver(self, what: str) -> None:
        if not self.memory_saver:  # sglang would return having freed nothing
            raise RuntimeError(f"backend 'sglang': {what} needs the engine started with "
                               "options={'enable_memory_saver': True} (ppo sets it when engines "
                               "offload, e.g. --colocate)")

    def bytes_in_use(self) -> int:
        """Device-wide used bytes on a real GPU: sglang allocates in its scheduler process,
        which this process's allocator cannot see."""
        if self.memory.kind == "cuda":
            free, total = torch.cuda.mem_get_info(0)
            return total - free
        return self.memory.bytes_in_use()

    # -- weights ----------------------------------------------------------------------
    def load_weights(self, bucket: dict) -> int:
        named = unpack_bucket(bucket)
        for name, tensor in named:
            shape = self.specs.get(name)
            if shape is None:
                raise ValueError(f"update_weights: unknown tensor {name!r}: not in the checkpoint "
                                 f"the engine was started from (HF names, e.g. {next(iter(self.specs))!r})")
            if list(tensor.shape) != shape:
                raise ValueError(f"update_weights: tensor {name!r} has shape {list(tensor.shape)}, "
                                 f"the checkpoint's is {shape}")
            if dtype_name(tensor.dtype) != self.dtype:
                raise ValueError(f"update_weights: tensor {name!r} has dtype {dtype_name(tensor.dtype)}, "
                                 f"the engine runs in {self.dtype}; cast on the sender")
        if not self._updating:
            self._begin_update()
        device = torch.device("cuda", 0) if self.memory.kind == "cuda" else None
        parts = [(named, bucket["flat"], False)] if "flat" in bucket else direct_groups(named, DIRECT_GROUP_BYTES)
        for part, flat, owned in parts:
            payloads = flattened_bucket_payloads(part, flat, num_ranks=self.tp_size, sgl=self.sgl, device=device,
                                                 owned=owned)
            success, message = self.engine.update_weights_from_tensor(
                named_tensors=payloads, load_format="flattened_bucket", flush_cache=False)
            if not success:
                raise RuntimeError(f"sglang rejected a weight bucket of {len(part)} tensors: {message}")
            del payloads, flat  # freed before `direct_groups` gathers the next part: one part at a time
        self._discarded.difference_update(self._aliases.get(name, name) for name, _ in named)
        return len(named)

    def _begin_update(self) -> None:
        # As miles: drop the prefix cache of the old weights, then open the session.
        flushed = self.engine.flush_cache()
        if not flushed.success:  # its scheduler refuses while requests are queued or running (no message)
            raise RuntimeError("sglang could not flush its cache before a weight update: "
                               f"{flushed.message or 'requests are still queued or running'}; nothing was loaded")
        success, message = self.engine.begin_weight_update()
        if not success:
            raise RuntimeError(f"sglang refused begin_weight_update(): {message}")
        self._updating = True

    def finish_weight_update(self) -> None:
        if not self._updating:  # a version set without new weights (e.g. after --load)
            return
        success, message = self.engine.end_weight_update()
        if not success:
            raise RuntimeError(f"sglang refused end_weight_update(): {message}")
        self._updating = False

    def shutdown(self) -> None:
        """sglang's Engine.shutdown(): kills its scheduler and detokenizer and waits until the
        scheduler has released its GPU context (engine.py:1450-1497), which the role's exit by
        os._exit would skip (it is an atexit hook there, engine.py:326)."""
        self.engine.shutdown()

    def weights_checksum(self) -> dict[str, str]:
        raise RuntimeError("weights_checksum needs backend 'torch': sglang offers no exact read-back "
                           "of its (fused, possibly sharded) weights")

    # -- generation -------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], seeds: list[int], board: AbortBoard | None = None
                 ) -> list[dict]:
        """Results in request order; with an abort `board` (a partial rollout, module docstring
        "partial rollouts") the requests the driver's abort stopped come back with finish_reason
        "abort" and their tokens so far."""
        if not requests:  # sglang would raise ValueError("input_ids cannot be empty."): io_struct.py:499
            return []
        self._check_weights_whole()
        # built outside the try: only sglang's own ValueError is an abort
        input_ids = [r.prompt_ids for r in requests]
        sampling_params = [_sampling_params(r, seed if self.deterministic else None) for r, seed in zip(requests, seeds)]
        call = uuid.uuid4().hex  # sglang's rids must be unique among the requests it holds
        rids = [f"tandem-{call}-{r.id}" for r in requests]
        watch = BoardWatch(self.engine, board, rids, [r.id for r in requests]) if board is not None else None
        try:
            outputs = self.engine.generate(input_ids=input_ids, sampling_params=sampling_params, return_logprob=True,
                                           rid=rids)
        except (ValueError, self.sgl.HTTPException) as e:
            # An abort that sglang raises (module docstring, "aborts") names no request and
            # loses the batch's other results: every request of the call is issued again.
            raise RequestsAborted([r.id for r in requests], f"sglang {type(e).__name__}: {e}") from None
        finally:
            if watch is not None:
                watch.stop()
        results, aborted, reason = [], [], ""
        for r, out in zip(requests, outputs):
            returned = _returned_abort(r, out)
            if returned and watch is not None and watch.sent:
                results.append(_result(r, out, partial=True))  # the driver's abort: its tokens so far
            elif returned:  # an abort sglang returns
                aborted.append(r.id)
                reason = returned
            else:
                results.append(_result(r, out))
        if aborted:
            raise RequestsAborted(aborted, reason, results)
        return results

    def stream(self, requests: list[GenerateRequest], seeds: list[int], wait_s: float | None) -> list[dict]:
        """Send each request as its own async_generate (module docstring, "streamed generation"),
        run the Engine's loop until one of the requests out has finished or wait_s passed (None:
        no limit), and
        return the finished results; aborted requests raise RequestsAborted with them."""
        self._check_weights_whole()
        loop = self.engine.loop
        for r, seed in zip(requests, seeds):
            params = _sampling_params(r, seed if self.deterministic else None)
            task = loop.create_task(self.engine.async_generate(input_ids=r.prompt_ids, sampling_params=params,
                                                               return_logprob=True))
            self._streaming[r.id] = (r, task)
        if not self._streaming:
            return []
        loop.run_until_complete(asyncio.wait([t for _, t in self._streaming.values()], timeout=wait_s,
                                             return_when=asyncio.FIRST_COMPLETED))
        results, aborted, reason = [], [], ""
        for rid, (r, task) in list(self._streaming.items()):
            if not task.done():
                continue
            del self._streaming[rid]
            try:
                out = task.result()
            except (ValueError, self.sgl.HTTPException) as e:  # this request's abort, raised (module docstring)
                aborted.append(rid)
                reason = f"sglang {type(e).__name__} for request id={rid}: {e}"
                continue
            returned = _returned_abort(r, out)
            if returned:
                aborted.append(rid)
                reason = returned
            else:
                results.append(_result(r, out))
        if aborted:
            raise RequestsAborted(aborted, reason, results)
        return results

    def drop_stream(self) -> None:
        """Wait for the stream's requests to end and forget their answers."""
        tasks = [t for _, t in self._streaming.values()]
        self._streaming.clear()
        if tasks:
            self.engine.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def _check_weights_whole(self) -> None:
        if self._discarded:
            missing = sorted(self._discarded)
            raise RuntimeError(f"backend 'sglang': the engine's weights were released without a CPU backup, "
                               f"so sglang threw their contents away, and {len(missing)} tensors (e.g. "
                               f"{missing[:2]}) were not loaded since; push the weights (update_weights per "
                               "bucket, then set_weight_version) before generating, or start the engine with "
                               "options={'enable_weights_cpu_backup': True}")


def _returned_abort(request: GenerateRequest, output: dict) -> str | None:
    """The reason, where sglang returned the request aborted rather than raising (module docstring)."""
    finish = output["meta_info"].get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return f"sglang aborted request id={request.id}: {finish.get('message')} (status {finish.get('status_code')})"
    return None


def _sampling_params(request: GenerateRequest, seed: int | None) -> dict:
    s = request.sampling
    params = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    if seed is not None:
        params["sampling_seed"] = seed
    return params


class BoardWatch:
    """A partial rollout's board beside one `Engine.generate` call (module docstring, "partial
    rollouts"). `Engine.generate` holds the calling thread in its event loop until the batch is
    done, so a thread asks that loop, every POLL_S, to run `_poll`: it marks the requests sglang
    finished on the board and, once the driver has aborted, sends `abort_request(abort_all=True)`
    once. sglang's tokenizer manager is not thread-safe; run on its own loop, `_poll` is."""

    POLL_S = 0.005

    def __init__(self, engine, board: AbortBoard, rids: list[str], ids: list[int]):
        self.engine, self.board = engine, board
        self.pending = dict(zip(rids, ids))  # not yet marked finished
        self.states: dict[str, object] = {}  # sglang's ReqState of each rid, once seen
        self.sent = False
        self._done = threading.Event()
        # The first poll runs right after the call's first step, which makes every request's
        # ReqState before it awaits anything (generate_request, tokenizer_manager.py:926; 0.5.21:
        # 885): it sees them all, even one that finishes before the thread's first poll.
        # (Queued now, `_arm` runs before that step; the poll it queues runs after.)
        engine.loop.call_soon(self._arm)
        self._thread = threading.Thread(target=self._run, name="sglang-board-watch", daemon=True)
        self._thread.start()

    def _arm(self) -> None:
        self.engine.loop.call_soon(self._poll)

    def _run(self) -> None:
        while not self._done.wait(self.POLL_S):
            self.engine.loop.call_soon_threadsafe(self._poll)

    def _poll(self) -> None:
        if self._done.is_set():  # queued before the call returned: the board may be closed
            return
        if self.sent:  # what finishes now is the abort's: the driver reads the call's results
            return
        live = self.engine.tokenizer_manager.rid_to_state
        for rid in list(self.pending):
            state = self.states.get(rid) or live.get(rid)
            if state is None:
                continue
            self.states[rid] = state  # kept: sglang drops a finished request's state
            if state.finished:  # set as its last output arrives: tokenizer_manager.py:2619 (0.5.21: 2483)
                self.board.finish(self.pending.pop(rid))
        # abort only once sglang holds every request: an abort_all sent before a request reached
        # its scheduler would miss it (scheduler.py:5675-5810 aborts what the scheduler holds)
        if self.board.aborted() and all(rid in self.states for rid in self.pending):
            self.engine.tokenizer_manager.abort_request(abort_all=True)
            self.sent = True

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _result(request: GenerateRequest, output: dict, partial: bool = False) -> dict:
    """Our result of sglang's `output`; `partial`: an output the driver's abort stopped (its
    tokens so far, finish_reason "abort")."""
    meta = output["meta_info"]
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else None
    if partial:
        reason = "abort"
    elif reason not in ("stop", "length"):
        raise RuntimeError(f"sglang did not finish request id={request.id}: finish_reason={finish}")
    entries = meta["output_token_logprobs"]
    token_ids = [int(e[1]) for e in entries]
    if list(output["output_ids"]) != token_ids:
        raise RuntimeError(f"sglang request id={request.id}: output_ids and output_token_logprobs disagree")
    return {"id": request.id, "token_ids": token_ids,
            "logprobs": [float(e[0]) for e in entries], "finish_reason": reason}
