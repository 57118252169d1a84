"""The model shape read from an HF config, and the megatron-core TransformerConfig it maps to.

Pure torch (no megatron import), so CI on Python 3.11 tests the mapping; `build_gpt_model`
in roles.trainer.megatron.model turns the kwargs into megatron objects on the GPU.

Covered: Qwen3 (GQA, qk-norm, RMSNorm, SwiGLU, head_dim, tied embeddings) and Llama/Qwen2-style
dense models (Qwen2's q/k/v biases). Anything else is refused here, at validation, with the
field that makes it unsupported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


@dataclass(kw_only=True, frozen=True)
class ModelShape:
    """What the mapper and the model builder need to know about one dense decoder."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int  # key/value heads (GQA)
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before rotary
    qkv_bias: bool  # Qwen2: biases on q, k, v projections
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    def padded_vocab(self, tp_size: int) -> int:
        """Vocab rows megatron holds: a multiple of tp_size (vocab-parallel embedding/output).

        Rows past vocab_size are zero on load, dropped on export, and cut out of the
        log-softmax (roles.trainer.megatron.logprobs.vocab_shard).
        """
        return -(-self.vocab_size // tp_size) * tp_size

    def check_parallel(self, *, tp_size: int, pp_size: int) -> None:
        """Refuse TP/PP sizes this shape cannot be split by; the message names the numbers."""
        if self.num_query_groups % tp_size or self.num_heads % tp_size:
            raise ValueError(
                f"tensor_model_parallel_size={tp_size} must divide num_key_value_heads="
                f"{self.num_query_groups} and num_attention_heads={self.num_heads}"
            )
        if self.ffn_hidden_size % tp_size:
            raise ValueError(f"tensor_model_parallel_size={tp_size} must divide intermediate_size={self.ffn_hidden_size}")
        if self.num_layers % pp_size:
            raise ValueError(
                f"pipeline_model_parallel_size={pp_size} must divide num_hidden_layers={self.num_layers} "
                "(uneven pipeline stages are not built)"
            )


def shape_from_hf(cfg: Any) -> ModelShape:
    """ModelShape from an HF PretrainedConfig (or a dict of its fields)."""
    get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
    model_type = get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"megatron backend: model_type={model_type!r} is not built; supported: {SUPPORTED_MODEL_TYPES}"
        )
    for field, ok in (("hidden_act", get("hidden_act", "silu") == "silu"),
                      ("rope_scaling", not _rope_scaling(get)),
                      ("use_sliding_window", not get("use_sliding_window", False)),
                      ("mlp_bias", not get("mlp_bias", False))):
        if not ok:
            raise ValueError(f"megatron backend: {model_type} with {field}={get(field)!r} is not built")
    num_heads = get("num_attention_heads")
    hidden = get("hidden_size")
    return ModelShape(
        num_layers=get("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=get("intermediate_size"),
        num_heads=num_heads,
        num_query_groups=get("num_key_value_heads") or num_heads,
        head_dim=get("head_dim") or hidden // num_heads,
        vocab_size=get("vocab_size"),
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
        rope_theta=float(_rope_theta(get)),
        norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=get("max_position_embeddings", 4096),
    )


def _rope_parameters(get) -> dict:
    return get("rope_parameters", None) or {}


def _rope_theta(get) -> float:
    # transformers 5 moves rope_theta into rope_parameters; 4.x keeps it at the top level.
    return _rope_parameters(get).get("rope_theta") or get("rope_theta", 10000.0)


def _rope_scaling(get) -> bool:
    """True when the config asks for a rotary scaling that megatron's plain RoPE would ignore."""
    scaling = get("rope_scaling", None) or _rope_parameters(get)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return kind not in (None, "default")


def transformer_config_kwargs(
    shape: ModelShape,
    *,
    tp_size: int,
    pp_size: int,
    cp_size: int,
    dtype: str,
    recompute_granularity: str | None,
    recompute_method: str | None,
    recompute_num_layers: int | None,
) -> dict:
    """Keyword arguments of megatron.core.transformer.TransformerConfig for this shape.

    As in megatron's own training: the model holds its weights in the compute dtype
    (params_dtype) and the optimizer keeps float32 main copies (get_megatron_optimizer
    with bf16/fp16 set), so there is no autocast and no fp32 weight read per matmul.
    """
    torch_dtype = getattr(torch, dtype)
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        qk_layernorm=shape.qk_norm,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        # megatron's bias_swiglu_impl (fused_bias_swiglu.py): SwiGLU as one autograd Function
        # saving only fc1's output, forward and backward each one torch.compile'd kernel
        # (megatron.core.jit: jit_fuser is torch.compile on torch >= 2.2; no transformer-engine
        # or apex; no bias here). In the training dtypes only: float32 runs are the GPU tests'
        # references, up to 13 processes at once, which would each pay a cold compile.
        bias_activation_fusion=dtype in ("bfloat16", "float16"),
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,  # needs apex's fused wgrad kernel
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
        tensor_model_parallel_size=tp_size,
        pipeline_model_parallel_size=pp_size,
        context_parallel_size=cp_size,
        # Off: the trainer's output processor picks response rows out of the whole packed
        # sequence (roles.trainer.megatron.core.forward), and sequence parallelism needs
        # reduce-scatter / all-gather-into-tensor that gloo lacks on CUDA (the one-GPU proof).
        # It costs activation memory (norms and dropout regions replicated over TP).
        sequence_parallel=False,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        variable_seq_lengths=True,  # packed micro-batches differ in length
        # dense model: no MoE, but TransformerConfig refuses variable_seq_lengths with the
        # default "allgather" dispatcher whatever the expert count
        moe_token_dispatcher_type="alltoall",
    )
    if recompute_granularity is not None:
        kwargs["recompute_granularity"] = recompute_granularity
        if recompute_granularity == "full":
            kwargs["recompute_method"] = recompute_method
            kwargs["recompute_num_layers"] = recompute_num_layers
    return kwargs


RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute(granularity: str | None, method: str | None, num_layers: int | None) -> None:
    """miles' flags: --recompute-granularity full needs a method and a layer count."""
    if granularity is None:
        if method is not None or num_layers is not None:
            raise ValueError(
                f"recompute_method={method!r} / recompute_num_layers={num_layers!r} are set but "
                "recompute_granularity is not. Please add --recompute-granularity full"
            )
        return
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={granularity!r}, expected one of {RECOMPUTE_GRANULARITIES}")
    if granularity == "full":
        if method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method={method!r}, expected one of {RECOMPUTE_METHODS} with full recompute")
        if num_layers is None or num_layers < 1:
            raise ValueError(f"recompute_num_layers={num_layers!r}, expected >= 1 with full recompute")
