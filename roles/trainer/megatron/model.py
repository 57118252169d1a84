"""Building megatron-core's GPTModel (actor) and its value-head variant (critic).

Imports megatron lazily: this module is imported by the trainer, which CI imports on
Python 3.11 without megatron-core; building a model needs megatron-core (Python >= 3.12).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from roles.model_spec import ModelSpec

# The critic's value head init, as miles' LinearForLastLayer: normal(0, 0.02), bias 0.
VALUE_HEAD_INIT_STD = 0.02

logger = logging.getLogger(__name__)


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def use_transformer_engine(transformer_impl: str) -> bool:
    """Whether the layers are transformer-engine's: only when asked for (MegatronTrainerConfig
    .transformer_impl, --transformer-impl), never because the package happens to import (its
    layers change the numerics, the parameter names and the RoPE path). Asked for and not
    importable is an error; the choice is logged."""
    use_te = transformer_impl == "transformer_engine"
    if use_te and not transformer_engine_available():
        raise RuntimeError("--transformer-impl transformer_engine, but transformer_engine does not import here: "
                           "install transformer-engine or use --transformer-impl local")
    logger.info("megatron layers: %s (--transformer-impl %s)",
                "transformer-engine's spec" if use_te else "local spec, built-in SDPA/varlen attention",
                transformer_impl)
    return use_te


def layer_spec(shape: ModelSpec, *, use_te: bool):
    """transformer-engine's layer spec when asked for (megatron applies its fused RoPE),
    else megatron's local spec with roles.trainer.megatron.attention.SDPACoreAttention as core
    attention, which applies the spec's RoPE itself (roles.rope; the model then has none of its own)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    from roles.trainer.megatron.attention import SDPACoreAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=shape.qk_norm, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=SDPACoreAttention, params={"rope": shape.rope})
    return spec


def position_embedding_type(*, use_te: bool) -> str:
    """megatron's own RoPE with transformer-engine (fused); none on the local spec, whose core
    attention rotates q and k itself without megatron's host-syncing THD path."""
    return "rope" if use_te else "none"


class ValueHead(nn.Module):
    """Linear(hidden, 1) with bias, replicated on every TP rank; called as megatron calls its
    output layer (returns (output, bias=None))."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        with torch.no_grad():
            self.weight.normal_(0.0, VALUE_HEAD_INIT_STD)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return nn.functional.linear(hidden, self.weight, self.bias), None


def build_gpt_model(shape: ModelSpec, config, *, tp_size: int, critic: bool, use_te: bool,
                    pre_process: bool, post_process: bool):
    """One pipeline stage's GPTModel; `config` is a megatron TransformerConfig."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(shape, use_te=use_te),
        vocab_size=shape.padded_vocab(tp_size),
        max_sequence_length=shape.max_positions,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,  # logits stay vocab-parallel; roles.trainer.megatron.logprobs reduces
        share_embeddings_and_output_weights=shape.tied_embeddings and not critic,
        position_embedding_type=position_embedding_type(use_te=use_te),
        rotary_base=int(shape.rope.theta),  # read only with "rope" (te spec); megatron_spec refused scaling
    )
    # megatron's local-spec norms (torch.nn.RMSNorm) are created in float32 on the CPU whatever
    # params_dtype says; in the compute dtype on the GPU like every other weight (megatron's
    # Float16Module would cast them; the distributed optimizer's param buffer would move them,
    # the plain optimizer does not).
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.to(config.params_dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    model.to(device)
    if critic and post_process:
        model.output_layer = ValueHead(shape.hidden_size, config.params_dtype, device)
    return model
