"""Loading the actor (HF causal LM) and critic (HF backbone + value head), and their forwards.

Both keep float32 master weights and run the forward under autocast to the compute dtype:
AdamW updates of ~1e-6 relative size vanish when added to bfloat16 weights.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from algorithms import entropy_from_logits
from roles.trainer.batching import MicroBatch

# The critic's value head init, as miles' LinearForLastLayer (adapted from verl):
# weight ~ normal(0, 0.02), bias zero
# (radixark/miles miles/backends/megatron_utils/model_provider.py, LinearForLastLayer).
VALUE_HEAD_INIT_STD = 0.02


def _prepare(model: PreTrainedModel, gradient_checkpointing: bool) -> PreTrainedModel:
    if getattr(model.config, "final_logit_softcapping", None):
        # policy_log_probs applies the output embedding to gathered hidden states itself,
        # bypassing forward(); a softcap there would be silently skipped.
        raise ValueError(
            f"{model.config.model_type}: final_logit_softcapping is not supported by the torch trainer"
        )
    if gradient_checkpointing:
        enable_checkpointing(model)
    model.config.use_cache = False
    return model


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute every decoder layer in backward (non-reentrant torch checkpoint).

    transformers renamed the call: recent 5.x has `activation_checkpointing_enable` (and keeps
    `gradient_checkpointing_enable` as a deprecated alias), earlier versions, such as the GPU
    image's 5.x, only `gradient_checkpointing_enable`.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_policy(path: str, *, gradient_checkpointing: bool = False) -> PreTrainedModel:
    """The actor: AutoModelForCausalLM from an HF dir, float32 master weights, on the CPU."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return _prepare(model, gradient_checkpointing)


class ValueModel(nn.Module):
    """The critic: the same architecture's backbone (AutoModel) and a scalar value head."""

    def __init__(self, backbone: PreTrainedModel, *, seed: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.value_head.weight.normal_(0.0, VALUE_HEAD_INIT_STD, generator=gen)
            self.value_head.bias.zero_()


def load_value_model(path: str, *, seed: int, gradient_checkpointing: bool = False) -> ValueModel:
    """Backbone weights from an HF causal-LM (or base) dir; the LM head is dropped."""
    backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
    return ValueModel(_prepare(backbone, gradient_checkpointing), seed=seed)


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _hidden_before_response(backbone: nn.Module, mb: MicroBatch, device: torch.device) -> torch.Tensor:
    """Hidden states [n, Rm, H] at the positions that predict each response token.

    Response token r of a sample sits at prompt_len + r; the state before it (the last
    prompt token for r = 0) is at prompt_len + r - 1, which is where both the logits that
    predict the token and the critic's value of that state are read — the alignment of
    miles' get_responses (logits[start - 1 : end - 1]) and verl's critic. Positions past a
    sample's response are clamped into range and masked by the caller.
    """
    out = backbone(
        input_ids=mb.input_ids.to(device),
        attention_mask=mb.attention_mask.to(device),
        use_cache=False,
    )
    hidden = out.last_hidden_state  # [n, Lm, H]
    offsets = torch.arange(mb.response_width, device=device)
    positions = (mb.prompt_lens.to(device).unsqueeze(1) - 1 + offsets).clamp(max=hidden.shape[1] - 1)
    return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def policy_log_probs(
    model: PreTrainedModel,
    mb: MicroBatch,
    *,
    temperature: float,
    dtype: torch.dtype,
    with_entropy: bool,
    entropy_requires_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(response token) [n, Rm] float32, and the entropy [n, Rm] when asked.

    Logits are divided by the rollout temperature (as miles does) so the log-probs are
    those of the distribution the engine sampled from. Only response positions go through
    the LM head: full-sequence float32 logits would dominate memory at real vocab sizes.
    entropy_requires_grad=False computes the entropy as a metric only, without keeping
    its [n, Rm, V] intermediates for backward.
    """
    device = next(model.parameters()).device
    with autocast(device, dtype):
        hidden = _hidden_before_response(model.get_decoder(), mb, device)
        logits = model.get_output_embeddings()(hidden)
    logits = logits.float() / temperature  # [n, Rm, V]
    tokens = _response_tokens(mb).to(device)
    log_probs = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_requires_grad else logits.detach())
    return log_probs, entropy


def values_forward(model: ValueModel, mb: MicroBatch, *, dtype: torch.dtype) -> torch.Tensor:
    """V(state before response token r) [n, Rm] float32."""
    device = model.value_head.weight.device
    with autocast(device, dtype):
        hidden = _hidden_before_response(model.backbone, mb, device)
        values = model.value_head(hidden)
    return values.squeeze(-1).float()


def _response_tokens(mb: MicroBatch) -> torch.Tensor:
    """[n, Rm] response token ids; arbitrary ids past each response (masked by the caller)."""
    positions = mb.prompt_lens.unsqueeze(1) + torch.arange(mb.response_width)
    positions = positions.clamp(max=mb.input_ids.shape[1] - 1)
    return mb.input_ids.gather(1, positions)
