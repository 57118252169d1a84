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
from roles.rollout.config import EngineConfig
from roles.rollout.sampling import parse_requests, request_seed
from roles.rollout.streaming import Streams
from runtime import Actor, endpoint, wire

TAGS = ("weights", "kv_cache", "cuda_graph")
_GRAPH_HOLDS = ("weights", "kv_cache")  # what the graphs point into
# sglang's adapter releases its graphs with its kv_cache (SGLANG_TAGS) and knows no third tag
_BACKEND_TAGS = {"torch": TAGS, "sglang": ("weights", "kv_cache")}
STREAM_WAIT_S = 0.02  # longest a stream call decodes without a finish: new requests wait at most this to join
_MEMORY_STATES = ("ready", "kv_cache_released", "weights_released", "cuda_graph_released", "released")

wire.register_config(EngineConfig)  # it travels to the engine's process as itself


def _build_backend(name: str, hf_checkpoint: str, *, seed: int, **common):
    if name == "torch":
        from roles.rollout.torch_engine import TorchBackend

        return TorchBackend(hf_checkpoint, **common)  # seeds arrive per request
    from roles.rollout.sglang_backend import SglangBackend

    return SglangBackend(hf_checkpoint, seed=seed, **common)


class RolloutEngine(Actor):
    """One inference engine over an HF checkpoint, with a `torch` or `sglang` backend.

    Built from one EngineConfig (roles.rollout.config: checkpoint, backend, batch, memory and
    backend options).

    Constructing the engine loads the weights and reserves the KV cache on its GPU(s), so
    in a colocated group the engine must hold the GPUs' lease when it is spawned.
    """

    lifecycle = {
        "starting": frozenset({"ready"}),
        **{s: frozenset(_MEMORY_STATES) - {s} for s in _MEMORY_STATES},
        "generating": frozenset({"ready"}),
    }
    lifecycle["ready"] = lifecycle["ready"] | {"generating"}

    def __init__(self, config: EngineConfig):
        if not isinstance(config, EngineConfig):
            raise TypeError(f"RolloutEngine takes an EngineConfig (roles.rollout.config), "
                            f"got {type(config).__name__}")
        self.config = config
        spec = ModelSpec.from_checkpoint(config.hf_checkpoint)
        self._vocab_size, self._max_positions = spec.vocab_size, spec.max_positions
        holder = self.context.name if self.context is not None else f"rollout-{config.engine_index}"
        self._memory = DeviceMemory(holder)
        self._backend_tags = _BACKEND_TAGS[config.backend]
        t0 = time.time()
        self._backend = _build_backend(
            config.backend, config.hf_checkpoint, seed=config.seed, memory=self._memory, dtype=config.dtype,
            max_batch_size=config.max_batch_size, kv_cache_bytes=config.kv_cache_bytes,
            mem_fraction=config.mem_fraction, options=dict(config.options),
        )
        self._released: set[str] = set()
        self._weight_version = 0
        self._weight_group = None  # roles.weight_broadcast.WeightGroup, when on another node than the actor
        self._num_generate_calls = 0
        self._streams = Streams(self._backend, max_retries=config.max_request_retries,
                                where=f"rollout engine {config.engine_index}")
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
        are marked on it, and once the rollout is aborted (by the driver, or by the engines in
        lockstep), the call returns with the unfinished requests' tokens so far and
        finish_reason "abort" (not issued again). The request ids are one chunk of the board.
        """
        if isinstance(requests, list) and not requests:  # nothing to generate needs no weights nor memory
            return []
        parsed, seeds = self._parse("generate", requests)
        self._drop_stream()  # one caller at a time: a stream's caller that sends this has moved on
        board = AbortBoard.open(abort_board, [r.id for r in parsed]) if abort_board is not None else None
        backend_generate = self._backend.generate if board is None else functools.partial(self._backend.generate,
                                                                                          board=board)
        self.set_state("generating", num_requests=len(parsed))
        try:
            where = f"rollout engine {self.config.engine_index}"
            check_in_run(where)  # side by side under MPS: still computing right
            results = generate_retrying(backend_generate, parsed, seeds, where=where,
                                        max_retries=self.config.max_request_retries)
        finally:
            if board is not None:
                board.close()
            self.set_state("ready")
        for result in results:
            result["weight_version"] = self._weight_version
        return results

    @endpoint
    def stream(self, session: str, requests: list[dict], wait_s: float | None = STREAM_WAIT_S) -> list[dict]:
        """Streamed generation: `requests` join the engine's running batch at once (taking slots as
        they free, beside the requests of earlier calls), the batch decodes until some request
        finishes or `wait_s` seconds pass (None: no time limit, so where the call ends depends on
        its requests alone: the driver's lockstep, ppo.generate.engines), and the call returns the
        results of the requests that finished (generate's format), in no particular order; the
        others keep running and come back from later calls. The caller calls again (with new requests or none) while any of
        its requests are out. So a trajectory's next turn joins the batch while the other
        trajectories' turns decode, instead of waiting for a whole `generate` call to end.

        `session`: the caller's name for its stream; a call of another session drops the
        requests of the earlier one (streaming.py), as does `generate` or a release. Request ids
        are unique within a session. Seeds as in generate; aborts are issued again as there.
        """
        if session != self._streams.session:
            self._streams.open(session)  # the earlier session's requests and kept K/V go, in one backend drop
            self._stop_generating()
        if isinstance(requests, list) and not requests and not len(self._streams):
            return []
        if wait_s is not None and (not isinstance(wait_s, (int, float)) or not 0 <= wait_s <= 60):
            raise ValueError(f"wait_s={wait_s!r} must be a number of seconds in [0, 60], or None (until a finish)")
        parsed, seeds = self._parse("stream", requests)
        try:
            if self.state != "generating":  # the state spans the stream, not each call (one event per stretch)
                self.set_state("generating", num_requests=len(parsed) + len(self._streams))
                check_in_run(f"rollout engine {self.config.engine_index}")  # once a stretch, not every call
            results = self._streams.call(parsed, seeds, wait_s)
        finally:
            if not len(self._streams):
                self.set_state("ready")
        for result in results:
            result["weight_version"] = self._weight_version
        return results

    def _drop_stream(self) -> None:
        self._streams.drop()
        self._stop_generating()

    def _stop_generating(self) -> None:
        if self.state == "generating":
            self.set_state("ready")

    def _parse(self, method: str, requests: list[dict]) -> tuple[list, list[int]]:
        """The requests validated, and their seeds (generate's docstring)."""
        if self._released:
            raise RuntimeError(
                f"rollout engine {self.config.engine_index}: {method}() while {sorted(self._released)} "
                f"released (state {self.state}); call resume({sorted(self._released)}) first"
            )
        parsed = parse_requests(requests, vocab_size=self._vocab_size, max_positions=self._max_positions)
        seeds = [request_seed(self.config.seed, self.config.engine_index, self._num_generate_calls, r) for r in parsed]
        self._num_generate_calls += 1
        return parsed, seeds

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
            self._drop_stream()  # the slots' contents go (a stream's caller releases only once it is done)
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
                f"rollout engine {self.config.engine_index}: update_weights() while the weights are "
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
    def join_weight_group(self, master_addr: str, master_port: int, world_size: int, rank: int,
                          backend: str) -> None:
        """Join the actor's weight broadcast group (roles.weight_broadcast) as `rank`: an engine on
        another node than the actor takes its buckets by `receive_weights` from then on."""
        from roles.weight_broadcast import WeightGroup

        self._weight_group = WeightGroup.join(master_addr, master_port, world_size, rank, backend)

    @endpoint
    def receive_weights(self, meta: dict) -> dict:
        """update_weights for a bucket whose tensor comes by the weight group's broadcast (the
        actor broadcasts it after this call was sent); `meta` is the bucket without its tensor.
        The broadcast is taken part in before any check, so that a refused bucket fails this
        call, not the actor's broadcast."""
        from roles.weight_broadcast import receive_bucket

        if self._weight_group is None:
            raise RuntimeError(f"rollout engine {self.config.engine_index}: receive_weights() before join_weight_group()")
        return self.update_weights(receive_bucket(self._weight_group, meta))

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
