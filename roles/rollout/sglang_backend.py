"""The production rollout backend: an adapter over sglang's in-process `sglang.Engine`.

It translates Tandem requests, results, memory tags and weight buckets to sglang's API:

- generate: `Engine.generate(input_ids=[...], sampling_params=[...], return_logprob=True)`;
  results come from `meta_info["output_token_logprobs"]` ((logprob, token_id, text)
  tuples) and `meta_info["finish_reason"]["type"]`. sglang's logprobs are those of the
  temperature-scaled distribution, as the torch backend's (see sampling.py).
- release/resume: `release_memory_occupation(tags=...)` / `resume_memory_occupation(tags=...)`
  with sglang's own tag names; our "kv_cache" also covers sglang's "cuda_graph" buffers,
  which serve the same decoding. The engine is started with `enable_memory_saver=True`,
  which these calls need (it requires the torch_memory_saver package).
- update_weights: `update_weights_from_tensor(load_format="flattened_bucket")`: our bucket
  already is a flat tensor plus (name, shape) metadata, so it goes as one payload per TP
  rank without re-packing. The cache is flushed once per update, in finish_weight_update.

sglang is imported lazily: only this backend needs it, and only on a GPU machine.
"""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import torch

from roles.device import DeviceMemory
from roles.rollout.sampling import GenerateRequest
from roles.weight_sync import dtype_name, unpack_bucket

# Engine arguments RolloutEngine sets itself; passing them in `options` would be ambiguous.
RESERVED_OPTIONS = frozenset({
    "model_path", "dtype", "random_seed", "mem_fraction_static", "max_running_requests",
    "skip_tokenizer_init", "enable_memory_saver",
})
SGLANG_TAGS = {"weights": ["weights"], "kv_cache": ["kv_cache", "cuda_graph"]}


def import_sglang() -> SimpleNamespace:
    """The three sglang names the adapter uses, or an ImportError saying what to do."""
    try:
        import sglang
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError as e:
        raise ImportError(
            "rollout backend 'sglang' needs the sglang package, which is not importable here "
            f"({e}); install it on the GPU machine (pip install 'sglang[all]') or use backend 'torch'"
        ) from e
    return SimpleNamespace(
        Engine=sglang.Engine,
        MultiprocessingSerializer=MultiprocessingSerializer,
        FlattenedTensorMetadata=FlattenedTensorMetadata,
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
    with open(os.path.join(hf_checkpoint, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in specs:  # saved once; trainers may still send both names
        specs["lm_head.weight"] = specs["model.embed_tokens.weight"]
    return specs


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
        clash = sorted(RESERVED_OPTIONS & set(options))
        if clash:
            raise ValueError(f"backend 'sglang': options {clash} are set by RolloutEngine's own "
                             "arguments (dtype, seed, mem_fraction, max_batch_size); remove them")
        self.sgl = import_sglang()
        self.memory = memory
        self.dtype = dtype
        self.tp_size = options.get("tp_size", 1)
        self.specs = checkpoint_tensor_specs(hf_checkpoint)
        kwargs = dict(
            model_path=hf_checkpoint,
            dtype=dtype,
            random_seed=seed,
            max_running_requests=max_batch_size,
            skip_tokenizer_init=True,  # we speak token ids only
            enable_memory_saver=True,  # needed by release/resume_memory_occupation
            **options,
        )
        if mem_fraction is not None:
            kwargs["mem_fraction_static"] = mem_fraction
        self.engine = self.sgl.Engine(**kwargs)

    # -- memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        self.engine.release_memory_occupation(tags=[t for tag in tags for t in SGLANG_TAGS[tag]])

    def resume(self, tags: list[str]) -> None:
        self.engine.resume_memory_occupation(tags=[t for tag in tags for t in SGLANG_TAGS[tag]])

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
        flat, metadata, start = bucket["flat"], [], 0
        for name, tensor in named:
            metadata.append(self.sgl.FlattenedTensorMetadata(
                name=name, shape=tensor.shape, dtype=flat.dtype,
                start_idx=start, end_idx=start + tensor.numel(), numel=tensor.numel(),
            ))
            start += tensor.numel()
        payload = self.sgl.MultiprocessingSerializer.serialize(
            {"flattened_tensor": flat, "metadata": metadata}, output_str=True
        )
        # One payload per TP rank: each rank deserializes (and releases) its own copy.
        success, message = self.engine.update_weights_from_tensor(
            named_tensors=[payload] * self.tp_size, load_format="flattened_bucket", flush_cache=False
        )
        if not success:
            raise RuntimeError(f"sglang rejected a weight bucket of {len(named)} tensors: {message}")
        return len(named)

    def finish_weight_update(self) -> None:
        self.engine.flush_cache()  # prefix-cache entries were computed with the old weights

    def weights_checksum(self) -> dict[str, str]:
        raise RuntimeError("weights_checksum needs backend 'torch': sglang offers no exact read-back "
                           "of its (fused, possibly sharded) weights")

    # -- generation -------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], seeds: list[int]) -> list[dict]:
        outputs = self.engine.generate(
            input_ids=[r.prompt_ids for r in requests],
            sampling_params=[_sampling_params(r, seed) for r, seed in zip(requests, seeds)],
            return_logprob=True,
        )
        return [_result(r, out) for r, out in zip(requests, outputs)]


def _sampling_params(request: GenerateRequest, seed: int) -> dict:
    s = request.sampling
    return {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "max_new_tokens": s.max_new_tokens,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "sampling_seed": seed,  # used by sglang's deterministic sampling mode
    }


def _result(request: GenerateRequest, output: dict) -> dict:
    meta = output["meta_info"]
    reason = (meta.get("finish_reason") or {}).get("type")
    if reason not in ("stop", "length"):
        raise RuntimeError(f"sglang did not finish request id={request.id}: finish_reason={meta.get('finish_reason')}")
    entries = meta["output_token_logprobs"]
    token_ids = [int(e[1]) for e in entries]
    if "output_ids" in output and list(output["output_ids"]) != token_ids:
        raise RuntimeError(f"sglang request id={request.id}: output_ids and output_token_logprobs disagree")
    return {"id": request.id, "token_ids": token_ids,
            "logprobs": [float(e[0]) for e in entries], "finish_reason": reason}
