"""The rollout engine role: generates responses, hands its GPU memory over, takes new weights.

Lifecycle (Actor states, published as `state` events when spawned):

    ready --release(["kv_cache", "weights"])--> released
    released --resume(["weights"])--> kv_cache_released --update_weights(b)...--> (same)
    kv_cache_released --resume(["kv_cache"])--> ready

Memory tags: "weights", "kv_cache" and "cuda_graph" (the decode graphs and their pool).
Graphs hold the addresses of the weights and the KV cache, so "cuda_graph" rides along:
releasing "weights" or "kv_cache" releases it too, and it comes back by itself once both
are resident again (graphs are re-captured at first use). Releasing "cuda_graph" alone
frees only the graphs (state "cuda_graph_released"); resume(["cuda_graph"]) takes them back.
Callers that name only ["kv_cache", "weights"] (ppo/loop.py, ppo/gpu/colocation.py) thus free
and restore everything.

`generate` needs "ready"; `update_weights` needs the weights resident ("ready" or
"kv_cache_released"). A weight sync is: `update_weights(bucket)` per bucket (each return
is the ack that lets the sender reuse its buffer), then `set_weight_version(v)`, which
ends the update. Every result carries the weight version that produced it.
"""

from __future__ import annotations

import functools
import time
import traceback

import torch

from roles.compute_check import check_in_run
from roles.device import DeviceMemory
from roles.model_spec import ModelSpec
from roles.weight_sync import bucket_device, bucket_nbytes, received
from roles.rollout.abort_board import AbortBoard
from roles.rollout.aborts import generate_retrying
from roles.rollout.sampling import parse_requests, request_seed
from runtime import Actor, endpoint

TAGS = ("weights", "kv_cache", "cuda_graph")
_GRAPH_HOLDS = ("weights", "kv_cache")  # what the graphs point into
# sglang's adapter releases its graphs with its kv_cache (SGLANG_TAGS) and knows no third tag
_BACKEND_TAGS = {"torch": TAGS, "sglang": ("weights", "kv_cache")}
DTYPES = ("float32", "bfloat16", "float16")
_MEMORY_STATES = ("ready", "kv_cache_released", "weights_released", "cuda_graph_released", "released")


def _build_backend(name: str, hf_checkpoint: str, *, seed: int, **common):
    if name == "torch":
        from roles.rollout.torch_engine import TorchBackend

        return TorchBackend(hf_checkpoint, **common)  # seeds arrive per request
    from roles.rollout.sglang_backend import SglangBackend

    return SglangBackend(hf_checkpoint, seed=seed, **common)


class RolloutEngine(Actor):
    """One inference engine over an HF checkpoint, with a `torch` or `sglang` backend.

    Args:
      hf_checkpoint: HF checkpoint directory (config, safetensors, tokenizer).
      backend: "torch" (built in; CPU, fake GPUs, small models) or "sglang" (production).
      engine_index: this engine's index among the engines; names its ledger holder when
        run in-process and seeds requests that bring no seed.
      seed: base seed; see `generate`.
      dtype: compute dtype of the weights.
      max_batch_size: most requests decoded together (sglang: max_running_requests).
      kv_cache_bytes: torch only: KV-cache budget; default: max_batch_size full-context rows.
      mem_fraction: fraction of one GPU for weights + KV cache (sglang's mem_fraction_static;
        torch: the KV budget is that fraction of the device minus the weights).
      max_request_retries: how often a request the backend aborts (sglang's aborts; the
        built-in engine out of memory) is issued again before `generate` gives up (aborts.py).
      options: extra backend options: torch {"cuda_graphs", "compile", "triton", "sync_every", "load_format"}
        (torch_engine/backend.py); sglang: any other `sglang.Engine` keyword (tp_size,
        attention_backend, ...).

    Constructing the engine loads the weights and reserves the KV cache on its GPU(s), so
    in a colocated group the engine must hold the GPUs' lease when it is spawned.
    """

    lifecycle = {
        "starting": frozenset({"ready"}),
        **{s: frozenset(_MEMORY_STATES) - {s} for s in _MEMORY_STATES},
        "generating": frozenset({"ready"}),
    }
    lifecycle["ready"] = lifecycle["ready"] | {"generating"}

    def __init__(
        self,
        hf_checkpoint: str,
        *,
        backend: str = "torch",
        engine_index: int = 0,
        seed: int = 0,
        dtype: str = "bfloat16",
        max_batch_size: int = 64,
        kv_cache_bytes: int | None = None,
        mem_fraction: float | None = None,
        max_request_retries: int = 3,
        options: dict | None = None,
    ):
        if backend not in ("torch", "sglang"):
            raise ValueError(f"backend={backend!r} must be one of 'torch', 'sglang'")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {DTYPES}")
        if not isinstance(engine_index, int) or engine_index < 0:
            raise ValueError(f"engine_index={engine_index!r} must be an int >= 0")
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r} must be an int >= 1")
        if kv_cache_bytes is not None and (not isinstance(kv_cache_bytes, int) or kv_cache_bytes <= 0):
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes!r} must be a positive int or None")
        if mem_fraction is not None and not 0 < mem_fraction <= 1:
            raise ValueError(f"mem_fraction={mem_fraction!r} must be in (0, 1] or None")
        if not isinstance(max_request_retries, int) or isinstance(max_request_retries, bool) \
                or max_request_retries < 0:
            raise ValueError(f"max_request_retries={max_request_retries!r} must be an int >= 0")
        self.max_request_retries = max_request_retries
        self.engine_index = engine_index
        self.seed = seed
        spec = ModelSpec.from_checkpoint(hf_checkpoint)
        self._vocab_size, self._max_positions = spec.vocab_size, spec.max_positions
        holder = self.context.name if self.context is not None else f"rollout-{engine_index}"
        self._memory = DeviceMemory(holder)
        self._backend_tags = _BACKEND_TAGS[backend]
        t0 = time.time()
        self._backend = _build_backend(
            backend, hf_checkpoint, seed=seed, memory=self._memory, dtype=dtype,
            max_batch_size=max_batch_size, kv_cache_bytes=kv_cache_bytes, mem_fraction=mem_fraction,
            options=dict(options or {}),
        )
        self._released: set[str] = set()
        self._weight_version = 0
        self._num_generate_calls = 0
        # what it holds from the start: side by side the engine never releases, and this is
        # the one report of its bytes the monitor and the trace get
        in_use = self._backend.bytes_in_use()
        self.publish_span("load", t0, bytes=in_use, bytes_in_use=in_use)

    # -- generation -------------------------------------------------------------------
    @endpoint
    def generate(self, requests: list[dict], abort_board: str | None = None) -> list[dict]:
        """Generate one response per request, results in request order.

        request: {"id": int, "prompt_ids": [int], "sampling": {"temperature", "top_p",
        "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed"}} (see
        sampling.py for defaults and meaning). n samples of a prompt are n requests.
        result: {"id", "token_ids", "logprobs" (of each sampled token, temperature
        applied), "finish_reason": "stop" | "length", "weight_version", "num_aborts" (how
        often the backend aborted the request and it was issued again, with its seed)}.
        No requests: no results, in any memory state (the backend is not called). A request aborted more than
        `max_request_retries` times raises RequestsGaveUp naming it.

        A request without a seed is seeded from (engine seed, engine_index, call number,
        request id): a run is reproducible, and a request's sample never depends on the
        other requests in its batch.

        abort_board: a partial rollout's board (abort_board.py; ids are board slots): finishes
        are marked on it, and once the driver aborts, the call returns at once with the
        unfinished requests' tokens so far and finish_reason "abort" (not issued again).
        """
        if isinstance(requests, list) and not requests:  # nothing to generate needs no weights nor memory
            return []
        if self._released:
            raise RuntimeError(
                f"rollout engine {self.engine_index}: generate() while {sorted(self._released)} "
                f"released (state {self.state}); call resume({sorted(self._released)}) first"
            )
        parsed = parse_requests(requests, vocab_size=self._vocab_size, max_positions=self._max_positions)
        seeds = [request_seed(self.seed, self.engine_index, self._num_generate_calls, r) for r in parsed]
        self._num_generate_calls += 1
        board = AbortBoard.open(abort_board) if abort_board is not None else None
        if board is not None and any(not 0 <= r.id < board.num_requests for r in parsed):
            board.close()
            raise ValueError(f"rollout engine {self.engine_index}: with an abort board, request ids are its slots "
                             f"0..{board.num_requests - 1}; got ids {sorted(r.id for r in parsed)[:4]}...")
        backend_generate = self._backend.generate if board is None else functools.partial(self._backend.generate,
                                                                                          board=board)
        self.set_state("generating", num_requests=len(parsed))
        try:
            check_in_run(f"rollout engine {self.engine_index}")  # side by side under MPS: still computing right
            results = generate_retrying(backend_generate, parsed, seeds, where=f"rollout engine {self.engine_index}",
                                        max_retries=self.max_request_retries)
        finally:
            if board is not None:
                board.close()
            self.set_state("ready")
        for result in results:
            result["weight_version"] = self._weight_version
        return results

    def on_stop(self) -> None:
        """The role is stopped (runtime.actor): the backend's shutdown (sglang's Engine.shutdown(),
        the built-in engine's memory freed and reported). The runtime bounds it and then kills
        what is left."""
        backend = getattr(self, "_backend", None)  # None: __init__ failed before building it
        if backend is not None:
            backend.shutdown()

    # -- memory -----------------------------------------------------------------------
    @endpoint
    def release(self, tags: list[str]) -> dict:
        """Free "weights" (offloaded, kept for resume), "kv_cache" and/or "cuda_graph".

        Releasing "weights" or "kv_cache" releases "cuda_graph" too (module docstring).
        Returns {"state", "bytes_in_use"}: what the lease handoff reports as left behind.
        Releasing what is already released is a no-op.
        """
        tags = self._check_tags(tags)
        if set(tags) & set(_GRAPH_HOLDS):
            tags = self._check_tags([*tags, "cuda_graph"])
        todo = [t for t in tags if t not in self._released]
        if todo:
            t0, before = time.time(), self._backend.bytes_in_use()
            mine = [t for t in todo if t in self._backend_tags]
            if mine:  # sglang: an empty tag list would mean "everything"
                self._backend.release(mine)
            self._released.update(todo)
            self.set_state(self._memory_state())
            after = self._backend.bytes_in_use()
            self.publish_span("release", t0, tags=todo, bytes=before - after, bytes_in_use=after,
                              **self._copied(todo))
        return self.memory_report()

    def _copied(self, tags: list[str]) -> dict:
        """A move span's bytes copied, where known: only the weights are kept (copied out and
        back); the KV cache and the graphs are dropped and rebuilt, nothing copied."""
        if "weights" not in tags:
            return {"copied": 0}
        # None: not known here (sglang's weights live in its scheduler process)
        return {"copied": getattr(self._backend, "weights_bytes", None)}

    @endpoint
    def resume(self, tags: list[str]) -> dict:
        """Take back "weights", "kv_cache" and/or "cuda_graph" (needs the lease on fake/real GPUs).

        "cuda_graph" comes back with the last of "weights" and "kv_cache"; alone, it needs both.
        """
        tags = self._check_tags(tags)
        resident_after = set(TAGS) - (self._released - set(tags))
        if "cuda_graph" in tags and not set(_GRAPH_HOLDS) <= resident_after:
            raise ValueError(f"resume(['cuda_graph']) needs the weights and the KV cache resident; "
                             f"resume({sorted(set(_GRAPH_HOLDS) - resident_after)}) with it")
        if set(_GRAPH_HOLDS) <= resident_after:
            tags = self._check_tags([*tags, "cuda_graph"])
        todo = [t for t in tags if t in self._released]
        if todo:
            t0, before = time.time(), self._backend.bytes_in_use()
            mine = [t for t in todo if t in self._backend_tags]
            if mine:
                self._backend.resume(mine)
            self._released.difference_update(todo)
            self.set_state(self._memory_state())
            after = self._backend.bytes_in_use()
            self.publish_span("resume", t0, tags=todo, bytes=after - before, bytes_in_use=after,
                              **self._copied(todo))
        return self.memory_report()

    @endpoint
    def memory_report(self) -> dict:
        return {"state": self.state, "bytes_in_use": self._backend.bytes_in_use()}

    @endpoint
    def engine_state(self) -> str:
        """The lifecycle state: ready, kv_cache_released, weights_released, cuda_graph_released
        or released."""
        return self.state

    # -- weights ----------------------------------------------------------------------
    @endpoint
    def update_weights(self, bucket: dict) -> dict:
        """Load one weight bucket (roles.weight_sync format) by HF name; returning is the ack.

        Unknown names, shape or dtype mismatches raise ValueError naming the tensor, before
        any tensor of the bucket is written.
        """
        if "weights" in self._released:
            raise RuntimeError(
                f"rollout engine {self.engine_index}: update_weights() while the weights are "
                "released; call resume(['weights']) first"
            )
        bucket = received(bucket)
        try:
            num_tensors = self._backend.load_weights(bucket)
        except BaseException as exc:
            # the traceback's frames would keep the mapped sender memory alive (see below)
            traceback.clear_frames(exc.__traceback__)
            del bucket
            raise
        device = bucket_device(bucket)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # our ack lets the sender overwrite its buffer
        num_bytes = bucket_nbytes(bucket)
        # Drop the sender's memory mapped over CUDA IPC before the ack: a mapping kept alive
        # would stop the sender from freeing it (torch's IPC ref counts; roles.weight_sync).
        del bucket
        return {"num_tensors": num_tensors, "num_bytes": num_bytes}

    @endpoint
    def set_weight_version(self, version: int) -> None:
        """End a weight update: results from now on carry `version`."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise ValueError(f"version={version!r} must be an int")
        self._backend.finish_weight_update()
        self._weight_version = version

    @endpoint
    def weight_version(self) -> int:
        return self._weight_version

    @endpoint
    def weights_checksum(self) -> dict[str, str]:
        """HF name -> exact digest of the engine's weights (roles.weight_checksum.checksum_named_tensors)."""
        return self._backend.weights_checksum()

    # -- helpers ----------------------------------------------------------------------
    def _check_tags(self, tags: list[str]) -> list[str]:
        if not isinstance(tags, (list, tuple)) or not tags or not set(tags) <= set(TAGS):
            raise ValueError(f"tags={tags!r} must be a non-empty list drawn from {list(TAGS)}")
        return [t for t in TAGS if t in tags]  # fixed order: weights move before the cache

    def _memory_state(self) -> str:
        held = self._released & set(_GRAPH_HOLDS)
        if held == set(_GRAPH_HOLDS):
            return "released"
        if held:
            return f"{next(iter(held))}_released"
        return "cuda_graph_released" if self._released else "ready"
