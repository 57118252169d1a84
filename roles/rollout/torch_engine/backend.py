"""The built-in rollout backend: Tandem's own decoder, slot KV cache, CUDA graphs, batching.

Memory, under the engine's three tags (see RolloutEngine.release):
- "weights": the fused weight storages. Released = offloaded to pinned CPU memory on a
  real GPU (only the ledger changes on fake GPUs / CPU); resumed = copied back. Kept, not
  freed, so an engine resumed without a weight sync serves the weights it had. The pinned
  memory is one roles.device.HostBlock of the weights' bytes (torch's pinned allocator would
  pin 8 GiB for Qwen3-4B's 7.5 and keep them cached), allocated at the first release and
  reused by every later one: pinning 7.5 GiB of host pages costs seconds, the copy itself a
  fraction of one.
- "kv_cache": one buffer of `kv_cache_bytes`, allocated on resume, freed on release.
- "cuda_graph": the decode graphs and their pool. They hold the addresses of the other
  two, so the engine releases them whenever it releases either; they are captured again
  lazily at the first decode step that needs each batch size.
"""

from __future__ import annotations

import math

import torch

from roles.device import CUDA_BLOCK, DeviceMemory, HostBlock, nbytes_of
from roles.rollout.abort_board import AbortBoard
from roles.rollout.aborts import RequestsAborted
from roles.rollout.sampling import GenerateRequest
from roles.model_spec import ModelSpec
from roles.rollout.torch_engine.decoder import Decoder, Weights
from roles.rollout.torch_engine.graphs import DecodeGraphs
from roles.rollout.torch_engine.kv_cache import KVCache
from roles.rollout.torch_engine.scheduler import Scheduler

# cuda_graphs: capture decode steps (real GPU only). compile: fuse the elementwise ops with
# torch.compile (real GPU only; default on there). triton: decode by the Triton kernels of
# kernels.py (fused norm/rope/cache write, GQA split-K attention; real GPU only, default on
# there; off: torch ops and SDPA). sync_every: decode steps between host
# syncs (default 16 on a GPU, 1 elsewhere). load_format: "safetensors" (the checkpoint's
# weights) or "dummy" (random weights of the checkpoint's shapes, for benchmarks that load
# real ones through update_weights, as vLLM/sglang's load_format="dummy"). batch_invariant
# (default off): one prompt per prefill forward, decode over every slot at every step, decode
# attention unsplit, so each matmul and reduction of a request's forward has the shapes (and
# the rounding) it has in any other batch: its tokens and log-probs are bitwise the same alone
# and in any batch, in bf16 too, with the Triton kernels, as long as every call gets the same
# number of slots (the KV budget holds max_batch_size of them). The torch attention (triton off,
# and the CPU) still attends over a span that follows the batch. Cost: bench.rollout --batch-invariant.
# kv_reuse (default on): a trajectory's next turn continues its slot's K/V (prefixes.py); off,
# every turn prefills its whole context (bench.multi_turn's recompute peer). slot_len (tokens;
# default: shaped per batch from its longest request): every batch's slots hold this many
# positions, so requests whose own length says little of the trajectory's (a turn told where to
# stop) still find their earlier turns' slots; a longer request is refused.
TORCH_OPTIONS = {"cuda_graphs": bool, "compile": bool, "triton": bool, "sync_every": int, "load_format": str,
                 "batch_invariant": bool, "kv_reuse": bool, "slot_len": int}
LOAD_FORMATS = ("safetensors", "dummy")


class TorchBackend:
    def __init__(
        self,
        hf_checkpoint: str,
        *,
        memory: DeviceMemory,
        dtype: str,
        max_batch_size: int,
        kv_cache_bytes: int | None,
        mem_fraction: float | None,
        options: dict,
    ):
        options = _check_options(options)
        self.memory = memory
        self.spec = ModelSpec.from_checkpoint(hf_checkpoint)
        self._host: HostBlock | None = None  # page-locked host memory of the weights, once released
        self._pinned: dict[str, torch.Tensor] = {}  # the weights' views into it
        self.weights = Weights(self.spec, getattr(torch, dtype))
        self.weights.allocate(torch.device("cpu"))
        dummy = options.get("load_format", "safetensors") == "dummy"
        if not dummy:
            self.weights.load_checkpoint(hf_checkpoint)
        self._move_weights("device")
        if dummy:
            _dummy_init(self.weights)  # on the device: fast even at billions of weights
        self.kv_bytes_per_token = self.spec.kv_elements_per_token * self.weights.dtype.itemsize
        self.kv_cache_bytes = self._kv_budget(kv_cache_bytes, mem_fraction, max_batch_size)
        self.cache = KVCache(memory=memory, num_bytes=self.kv_cache_bytes, num_layers=self.spec.num_layers,
                             num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim,
                             dtype=self.weights.dtype, max_slots=max_batch_size)
        self.cache.allocate()
        on_gpu = memory.kind == "cuda"
        self.graphs = DecodeGraphs(memory, enabled=options.get("cuda_graphs", True))
        self.decoder = Decoder(self.weights, compile_ops=on_gpu and options.get("compile", True))
        self.scheduler = Scheduler(self.decoder, self.cache, self.graphs,
                                   sync_every=options.get("sync_every", 16 if on_gpu else 1),
                                   slot_quantum=64 if on_gpu else 1, span_quantum=64 if on_gpu else 1,
                                   fused=on_gpu and options.get("triton", True),
                                   batch_invariant=options.get("batch_invariant", False),
                                   kv_reuse=options.get("kv_reuse", True), slot_len=options.get("slot_len"))

    @property
    def weights_bytes(self) -> int:
        return nbytes_of(list(self.weights.storages.values()))

    def _kv_budget(self, kv_cache_bytes: int | None, mem_fraction: float | None, max_batch_size: int) -> int:
        if kv_cache_bytes is not None and mem_fraction is not None:
            raise ValueError("backend 'torch': give kv_cache_bytes or mem_fraction, not both")
        if kv_cache_bytes is not None:
            return kv_cache_bytes
        if mem_fraction is not None:
            capacity = self.memory.capacity_bytes()
            if capacity is None:
                raise ValueError("mem_fraction needs a GPU or fake GPU to take a fraction of; "
                                 "on the CPU give kv_cache_bytes instead")
            budget = int(capacity * mem_fraction) - self.weights_bytes
            if budget <= 0:
                raise ValueError(
                    f"mem_fraction={mem_fraction} of {capacity} bytes leaves no room for a KV cache "
                    f"after {self.weights_bytes} bytes of weights; raise mem_fraction"
                )
            return budget
        # Default: room for max_batch_size sequences of the model's full context.
        return max_batch_size * self.spec.max_positions * self.kv_bytes_per_token

    # -- memory -----------------------------------------------------------------------
    def release(self, tags: list[str]) -> None:
        """Free the tagged memory. The engine adds "cuda_graph" to any release of the other two."""
        if "cuda_graph" in tags:  # first: graphs point into the weights and the cache
            self.scheduler.drop_state()
        if "weights" in tags:
            self._move_weights("cpu")
        if "kv_cache" in tags:
            self.scheduler.drop_state()
            self.cache.free()

    def resume(self, tags: list[str]) -> None:
        """Restore the tagged memory; "cuda_graph" needs nothing now (graphs are captured on use)."""
        if "weights" in tags:
            self._move_weights("device")
        if "kv_cache" in tags:
            self.cache.allocate()

    def _move_weights(self, where: str) -> None:
        if self.memory.kind == "cuda":
            self._move_weights_pinned(where)
            return
        keys = list(self.weights.storages)
        moved = self.memory.move([self.weights.storages[k] for k in keys], where, tag="weights")
        self.weights.set_storages(dict(zip(keys, moved)))

    def _move_weights_pinned(self, where: str) -> None:
        """DeviceMemory.move's contract on a real GPU (account first on the way in; memory back
        to the driver on the way out) over one HostBlock that outlives the release."""
        storages = self.weights.storages
        if where == "device":
            self.memory.account("weights", nbytes_of(list(storages.values()), CUDA_BLOCK))
            self.weights.set_storages({k: t.to(self.memory.device, non_blocking=True) for k, t in storages.items()})
            return
        if self._host is None:
            self._host, self._pinned = _host_copy_of(storages, pin=True)
        for k, t in storages.items():
            if t.data_ptr() != self._pinned[k].data_ptr():
                self._pinned[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()  # the copies are async; finish before the device memory is reused
        self.weights.set_storages(dict(self._pinned))
        torch.cuda.empty_cache()
        self.memory.account("weights", 0)

    def bytes_in_use(self) -> int:
        return self.memory.bytes_in_use()

    # -- weights ----------------------------------------------------------------------
    def load_weights(self, bucket: dict) -> int:
        self.scheduler.forget_prefixes()  # K/V kept for later turns were computed with the old weights
        return self.weights.load_bucket(bucket)

    def finish_weight_update(self) -> None:
        """Weights were copied in place into the storages the graphs read: nothing to flush."""

    def weights_checksum(self) -> dict[str, str]:
        return self.weights.checksum()

    # -- generation -------------------------------------------------------------------
    def generate(self, requests: list[GenerateRequest], seeds: list[int], board: AbortBoard | None = None
                 ) -> list[dict]:
        """The scheduler's results; with an abort `board` (a partial rollout), those it stopped come
        back with finish_reason "abort" and their tokens so far (scheduler.py). Its aborts, as sglang's (roles/rollout/aborts.py): out of
        device memory aborts the whole call (the batch shares every buffer, so no request is
        to blame; the graphs and slot state are dropped, to be built again on the next try); a
        request whose log-probs are not finite (an internal error in its rows: a NaN from the
        forward) is aborted alone, the others' results kept."""
        if not requests:
            return []
        try:
            results = self.scheduler.generate(requests, seeds, board)
        except torch.OutOfMemoryError as e:
            self._out_of_memory()
            raise RequestsAborted([r.id for r in requests], f"out of memory in the built-in engine: {e}") from None
        return _finite(results)

    def stream(self, requests: list[GenerateRequest], seeds: list[int], wait_s: float | None) -> list[dict]:
        """The scheduler's `stream`: the results of the running batch's requests that finished. Its
        aborts are generate's: out of memory aborts every request the batch held (the running
        batch is dropped with the slot state), a non-finite result its own request."""
        try:
            results = self.scheduler.stream(requests, seeds, wait_s)
        except torch.OutOfMemoryError as e:
            ids = list(dict.fromkeys([*self.scheduler.held_ids(), *(r.id for r in requests)]))
            self._out_of_memory()
            raise RequestsAborted(ids, f"out of memory in the built-in engine: {e}") from None
        return _finite(results)

    def drop_stream(self) -> None:
        self.scheduler.drop_stream()

    def _out_of_memory(self) -> None:
        self.scheduler.drop_state()  # the graphs and slot state are built again on the next try
        if self.memory.kind == "cuda":
            torch.cuda.empty_cache()

    def shutdown(self) -> None:
        """Free the device memory (KV cache, graphs, weights) and say so in the ledger, so that
        an engine started next on this GPU finds it free."""
        self.scheduler.drop_state()
        self.cache.free()  # empties the allocator's cache on a GPU too
        self.weights.storages.clear()
        self.weights.named.clear()
        self.memory.account("weights", 0)


def _finite(results: list[dict]) -> list[dict]:
    """`results`, unless a request's log-probs are not finite (an internal error in its rows: a NaN
    from the forward): that request is aborted alone, the others' results kept."""
    bad = [r["id"] for r in results if not all(math.isfinite(lp) for lp in r["logprobs"])]
    if bad:
        raise RequestsAborted(bad, f"request id={bad[0]}: non-finite log-probs (an internal error in the "
                                   "built-in engine's forward)", [r for r in results if r["id"] not in bad])
    return results


def _check_options(options: dict) -> dict:
    unknown = sorted(set(options) - set(TORCH_OPTIONS))
    if unknown:
        raise ValueError(f"backend 'torch': unknown options {unknown}; allowed: {sorted(TORCH_OPTIONS)}")
    for name, kind in TORCH_OPTIONS.items():
        if name in options and type(options[name]) is not kind:
            raise ValueError(f"backend 'torch': option {name}={options[name]!r} must be a {kind.__name__}")
    if options.get("slot_len", 1) < 1:
        raise ValueError(f"backend 'torch': option slot_len={options['slot_len']} must be >= 1 (tokens)")
    if options.get("sync_every", 1) < 1:
        raise ValueError(f"backend 'torch': option sync_every={options['sync_every']} must be >= 1")
    if options.get("load_format", "safetensors") not in LOAD_FORMATS:
        raise ValueError(f"backend 'torch': option load_format={options['load_format']!r} must be one of {LOAD_FORMATS}")
    return options


HOST_ALIGN = 256  # bytes: each weight's slice of the host block starts on this boundary


def _host_copy_of(storages: dict[str, torch.Tensor], *, pin: bool) -> tuple[HostBlock, dict[str, torch.Tensor]]:
    """One HostBlock for all of `storages` (one registration), each in its own slice rounded
    up to HOST_ALIGN bytes so that every dtype view is aligned, and host tensors shaped like
    them, views into it. The caller keeps the block as long as it uses the views."""
    nbytes = [t.numel() * t.element_size() for t in storages.values()]
    block = HostBlock([-(-n // HOST_ALIGN) * HOST_ALIGN for n in nbytes], pin=pin)
    views = {k: v[:n].view(t.dtype).view(t.shape) for (k, t), v, n in zip(storages.items(), block.views, nbytes)}
    return block, views


def _dummy_init(weights: Weights) -> None:
    with torch.no_grad():
        for key, t in weights.storages.items():
            if t.dim() == 1 and "bias" not in key:
                t.fill_(1.0)  # norm scales
            else:
                t.normal_(0.0, 0.02, generator=torch.Generator(t.device).manual_seed(0))
