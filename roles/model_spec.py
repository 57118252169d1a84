"""The model spec: an HF config read once into a typed description, and every refusal.

The torch engine's decoder, the megatron trainer (its TransformerConfig, the HF<->megatron
mapper), the job's setup checks and ppo.make_model take a `ModelSpec`, never the raw
config, so a model one of them cannot run is refused here, at startup, naming the config field
and its value. Covered: dense Qwen3 (GQA, per-head q/k norms), Qwen2 (q/k/v biases), Llama
and Mistral, with plain RoPE or linear, llama3 or yarn scaling (roles.rope computes them).

Both spellings of RoPE are read: transformers 5 writes `rope_parameters` (rope_theta inside
it); 4.x writes `rope_theta` at the top level and the scaling as `rope_scaling` (its kind under
`rope_type`, or `type` in older files). pyproject allows both, and a 4.x checkpoint runs under 5.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Container, Iterable, Mapping

from roles.rope import ROPE_TYPES, Rope, yarn_mscale

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")

# Checkpoint tensors that a model built from the spec has no place for and may drop, each with
# why (`ModelSpec.ignores`); any other tensor without a place (q/k/v biases on an arch without
# them, a reward head) means the checkpoint is not the model its config describes, and every
# loader refuses it by name (`ModelSpec.refuse_unplaced`, megatron's mapper.unplaced_problem):
#   *.rotary_emb.inv_freq   RoPE's inverse frequencies, a buffer older exports saved; roles.rope
#                           computes them (transformers skips them too, modeling_utils.py)
#   lm_head.weight (tied)   with tied embeddings the output projection is the embedding (HF's
#                           tie_weights replaces a stored copy the same way)
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(kw_only=True, frozen=True)
class ModelSpec:
    """One dense decoder's shape and features."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int  # GQA: key/value heads (megatron's num_query_groups)
    head_dim: int
    vocab_size: int
    max_positions: int
    norm_eps: float  # RMSNorm epsilon
    tied_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    qkv_bias: bool  # Qwen2: biases on the q, k, v projections
    rope: Rope
    eos_ids: tuple[int, ...] = ()  # generation_config.json's when read from a checkpoint

    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | Any) -> ModelSpec:
        """From an HF config: a PretrainedConfig or a dict of config.json's fields."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        _refuse_unsupported(cfg)
        heads, hidden = _required(cfg, "num_attention_heads"), _required(cfg, "hidden_size")
        eos = cfg.get("eos_token_id")
        return cls(
            model_type=cfg["model_type"],
            num_layers=_required(cfg, "num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=_required(cfg, "intermediate_size"),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            vocab_size=_required(cfg, "vocab_size"),
            max_positions=cfg.get("max_position_embeddings", 4096),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=cfg["model_type"] == "qwen3",
            qkv_bias=cfg["model_type"] == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope=rope_from_hf(cfg),
            eos_ids=_eos_tuple(eos),
        )

    @classmethod
    def from_checkpoint(cls, hf_checkpoint: str) -> ModelSpec:
        """From an HF checkpoint directory, as transformers reads it (its config class fills the
        fields config.json leaves out, e.g. Qwen3's head_dim), with generation_config.json's eos ids."""
        from transformers import AutoConfig

        with open(os.path.join(hf_checkpoint, "config.json")) as f:
            _refuse_unsupported(json.load(f))  # before transformers meets a model_type it may not know
        cfg = AutoConfig.from_pretrained(hf_checkpoint).to_dict()
        path = os.path.join(hf_checkpoint, "generation_config.json")
        if os.path.exists(path):
            with open(path) as f:
                cfg["eos_token_id"] = json.load(f).get("eos_token_id", cfg.get("eos_token_id"))
        return cls.from_hf(cfg)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_elements_per_token(self) -> int:
        """KV-cache elements per token (all layers, K and V); times the dtype's itemsize for bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def padded_vocab(self, tp_size: int) -> int:
        """Vocab rows a vocab-parallel embedding/output holds: a multiple of tp_size.

        Rows past vocab_size are zero on load, dropped on export, and cut out of the
        log-softmax (roles.trainer.megatron.logprobs.vocab_shard).
        """
        return -(-self.vocab_size // tp_size) * tp_size

    def check_parallel(self, *, tp_size: int, pp_size: int) -> None:
        """Refuse TP/PP sizes this model cannot be split by; the message names the numbers."""
        if self.num_kv_heads % tp_size or self.num_heads % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide num_key_value_heads="
                f"{self.num_kv_heads} and num_attention_heads={self.num_heads}"
            )
        if self.intermediate_size % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide intermediate_size={self.intermediate_size}")
        if self.num_layers % pp_size:
            raise ValueError(
                f"pipeline_model_parallel_size={pp_size} must divide num_hidden_layers={self.num_layers} "
                "(uneven pipeline stages are not built)"
            )

    def ignores(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is one a model of this spec drops (IGNORED_TENSOR_SUFFIXES)."""
        return name.endswith(IGNORED_TENSOR_SUFFIXES) or (self.tied_embeddings and name == "lm_head.weight")

    def refuse_unplaced(self, names: Iterable[str], placed: Container[str], *, loader: str) -> None:
        """Refuse the first checkpoint tensor of `names` that the loader's model has no place for
        (not in `placed`, not one it `ignores`): dropping it would run another model than the
        checkpoint's, e.g. attention biases that config.json does not declare."""
        for name in names:
            if name not in placed and not self.ignores(name):
                raise ValueError(f"{loader}: checkpoint tensor {name!r} has no place in the {self.model_type} model "
                                 "that config.json describes; fix the config or the checkpoint")

    def check_plain_rope(self, backend: str) -> None:
        """Refuse RoPE scaling for a backend that builds plain RoPE only (megatron: with
        transformer-engine its own RotaryEmbedding takes nothing but rotary_base)."""
        if self.rope.kind != "default":
            raise ValueError(f"{backend}: {self.model_type} with RoPE scaling rope_type={self.rope.kind!r} "
                             "(rope_parameters / rope_scaling) is not built; it builds plain RoPE only")


def _refuse_unsupported(cfg: dict) -> None:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    for field, ok, why in (
        ("hidden_act", cfg.get("hidden_act", "silu") == "silu", "only 'silu' (SwiGLU)"),
        ("use_sliding_window", not cfg.get("use_sliding_window", False), "full attention only"),
        ("mlp_bias", not cfg.get("mlp_bias", False), "the MLP has no biases"),
        ("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0) == 1.0, "RoPE over the whole head only"),
    ):
        if not ok:
            raise ValueError(f"{model_type} with {field}={cfg.get(field)!r} is not supported: {why}")


def _required(cfg: dict, field: str):
    if cfg.get(field) is None:
        raise ValueError(f"the HF config lacks {field!r}; it is needed to build a {cfg.get('model_type')} model")
    return cfg[field]


def _eos_tuple(eos) -> tuple[int, ...]:
    return tuple([eos] if isinstance(eos, int) else eos or [])


def rope_from_hf(cfg: dict) -> Rope:
    """The config's RoPE, from transformers 5's `rope_parameters` or 4.x's `rope_scaling` and
    top-level `rope_theta`; scaling parameters default as transformers defaults them."""
    # transformers 5 reads a 4.x rope_scaling in preference to rope_parameters (convert_rope_params_to_dict)
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    params = dict(cfg.get(field) or {})
    nested = sorted(k for k, v in params.items() if isinstance(v, Mapping))
    if nested:
        raise ValueError(f"{field} per layer type ({nested}) is not supported: one RoPE for every layer only")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{field}: rope_type={kind!r} is not supported; supported: {ROPE_TYPES}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{field}: partial_rotary_factor={params['partial_rotary_factor']!r} is not supported: "
                         "RoPE over the whole head only")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if heads and hidden else 0)
    theta = float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    if kind == "default":
        return Rope(theta=theta, head_dim=head_dim)

    def need(name: str):
        if params.get(name) is None:
            raise ValueError(f"{field}: rope_type={kind!r} needs {name!r}; it is missing")
        return params[name]

    if kind == "linear":
        return Rope(theta=theta, head_dim=head_dim, kind=kind, factor=float(need("factor")))
    # the pretraining context: Phi3-style configs keep it at the top level, which transformers prefers
    original = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or cfg.get("max_position_embeddings")
    if kind == "llama3":
        return Rope(theta=theta, head_dim=head_dim, kind=kind, factor=float(need("factor")),
                    original_max_position_embeddings=original, low_freq_factor=float(need("low_freq_factor")),
                    high_freq_factor=float(need("high_freq_factor")))
    factor = params.get("factor") or cfg["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return Rope(theta=theta, head_dim=head_dim, kind=kind, factor=float(factor),
                original_max_position_embeddings=original, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)),
                attention_factor=float(attention_factor))

