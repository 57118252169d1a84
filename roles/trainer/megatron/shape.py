"""The model spec as the megatron backend takes it, and the megatron-core TransformerConfig it maps to.

Pure torch (no megatron import), so CI on Python 3.11 tests the mapping; `build_gpt_model`
in roles.trainer.megatron.model turns the kwargs into megatron objects on the GPU. What is
refused, and why, lives in roles.model_spec.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from roles.model_spec import ModelSpec


def megatron_spec(config: Mapping[str, Any] | Any) -> ModelSpec:
    """The model spec of an HF config (roles.model_spec), refused where this backend builds
    plain RoPE only (transformer-engine's spec applies megatron's own RotaryEmbedding)."""
    spec = ModelSpec.from_hf(config)
    spec.check_plain_rope("megatron backend")
    return spec


def transformer_config_kwargs(
    shape: ModelSpec,
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
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
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
