"""EngineConfig: everything one rollout engine is built from (RolloutEngine's one argument).

The driver builds it from the run's config (ppo.setup.role_configs.engine_config); tests and
benchmarks build it directly. The backends check their own `options` (torch_engine/backend.py
TORCH_OPTIONS; sglang_backend.py's reserved and refused `sglang.Engine` keywords).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("torch", "sglang")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True, frozen=True)
class EngineConfig:
    """One inference engine over an HF checkpoint.

    hf_checkpoint: HF checkpoint directory (config, safetensors, tokenizer).
    backend: "torch" (built in; CPU, fake GPUs, small models) or "sglang" (production).
    engine_index: this engine's index among the engines; names its ledger holder when run
      in-process and seeds requests that bring no seed.
    seed: base seed; see RolloutEngine.generate.
    dtype: compute dtype of the weights.
    max_batch_size: most requests decoded together (sglang: max_running_requests).
    kv_cache_bytes: torch only: KV-cache budget; None: max_batch_size full-context rows.
    mem_fraction: fraction of one GPU for weights + KV cache (sglang's mem_fraction_static;
      torch: the KV budget is that fraction of the device minus the weights).
    max_request_retries: how often a request the backend aborts (sglang's aborts; the
      built-in engine out of memory) is issued again before `generate` gives up (aborts.py).
    options: extra backend options: torch {"cuda_graphs", "compile", "triton", "sync_every",
      "batch_invariant", "load_format"} (torch_engine/backend.py); sglang: any other
      `sglang.Engine` keyword (tp_size, attention_backend, ...).
    """

    hf_checkpoint: str
    backend: str = "torch"
    engine_index: int = 0
    seed: int = 0
    dtype: str = "bfloat16"
    max_batch_size: int = 64
    kv_cache_bytes: int | None = None
    mem_fraction: float | None = None
    max_request_retries: int = 3
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"engine config: {name}={getattr(self, name)!r}, expected {allowed}")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if self.backend not in BACKENDS:
            raise bad("backend", f"one of {BACKENDS}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"one of {DTYPES}")
        if not is_int(self.engine_index) or self.engine_index < 0:
            raise bad("engine_index", "an int >= 0")
        if not is_int(self.max_batch_size) or self.max_batch_size < 1:
            raise bad("max_batch_size", "an int >= 1")
        if self.kv_cache_bytes is not None and (not is_int(self.kv_cache_bytes) or self.kv_cache_bytes <= 0):
            raise bad("kv_cache_bytes", "a positive int or None")
        if self.mem_fraction is not None and not 0 < self.mem_fraction <= 1:
            raise bad("mem_fraction", "in (0, 1] or None")
        if not is_int(self.max_request_retries) or self.max_request_retries < 0:
            raise bad("max_request_retries", "an int >= 0")
        if not isinstance(self.options, dict):
            raise bad("options", "a dict of backend options")
