"""Device memory a trainer holds only while it computes a micro-batch: activations, logits.

Fake GPUs cannot observe allocations, so a trainer charges these to its ledger for the
length of the computation (`DeviceMemory.transient`), estimated from shapes. The estimate
errs high: a colocation plan that fits the fake device should fit the real one.

Activations, per token and per decoder layer, in elements of the compute dtype: the
tensors autograd saves for the backward pass of a Qwen3/Llama-style layer with SDPA
attention (the attention-score matrix is never stored):

    two RMSNorms, input and output        4 h
    q: projection, q-norm, rope, output   4 q      q  = heads x head_dim
    k: projection, k-norm, rope; v        4 kv     kv = kv_heads x head_dim
    SwiGLU: gate, up, silu(gate), product 4 i      i  = intermediate size

so 4 (h + q + kv + i) elements, 27 h for Qwen3-4B (h 2560, q 4096, kv 1024, i 9728):
54 bytes per hidden unit per token per layer in bf16, against the 34 that Korthikanti et
al. (2022, "Reducing Activation Recomputation", eq. 1 less its score term) count for
GPT's narrower MLP and unnormed q/k. With gradient checkpointing each layer keeps only its
input (h) and one layer at a time is rebuilt; without gradients (log-probs, values)
nothing is saved and one layer's intermediates are alive at a time.

Logits (policy only; only response positions go through the LM head, roles.trainer.torch.model):
tokens x vocab in the compute dtype, their float32 copy and one float32 temporary of the
log-softmax; training adds the float32 gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from roles.model_spec import ModelSpec

if TYPE_CHECKING:  # the memory plan sizes activations without importing torch (launch.py --dry-run)
    from torch import nn


def layer_activation_elements(spec: ModelSpec) -> int:
    """Elements saved per token by one decoder layer (see the module note)."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    return 4 * (spec.hidden_size + q + kv + spec.intermediate_size)


def micro_batch_bytes(spec: ModelSpec, *, num_tokens: int, num_logit_tokens: int, width: int, training: bool,
                      gradient_checkpointing: bool = False, with_logits: bool = True) -> int:
    """Bytes one micro-batch holds on the device while it is computed.

    `num_tokens`: positions through the decoder (padded rows x padded width);
    `num_logit_tokens`: positions through the LM head; `width`: bytes per element of the compute
    dtype (its `itemsize`).
    """
    layer = layer_activation_elements(spec)
    if not training:
        per_token = layer + spec.hidden_size
    elif gradient_checkpointing:
        per_token = spec.num_layers * spec.hidden_size + layer
    else:
        per_token = spec.num_layers * layer
    total = num_tokens * per_token * width
    if with_logits:
        total += num_logit_tokens * spec.vocab_size * (width + 4 + 4 + (4 if training else 0))
    return total


def model_config(model: nn.Module) -> tuple[object, bool]:
    """(HF config, has an LM head) of a policy (HF causal LM) or a critic (backbone + value head)."""
    backbone = getattr(model, "backbone", None)
    if backbone is not None:
        return backbone.config, False
    return model.config, True
