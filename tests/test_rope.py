"""roles.rope: its frequencies against transformers' ROPE_INIT_FUNCTIONS (the slow twin the
torch trainer runs), and the engine's and the megatron trainer's RoPE built from it agreeing."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from roles.model_spec import ModelSpec
from roles.rope import Rope
from roles.rollout.torch_engine.decoder import Decoder, Weights, _attention_inputs
from roles.trainer.megatron import batch_memo
from roles.trainer.megatron.rope import apply_rope, cos_sin

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7,
                    "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False},
}


def llama(scaling: dict | None) -> LlamaConfig:
    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                       num_hidden_layers=2, vocab_size=100, max_position_embeddings=256, rope_theta=5e5,
                       rope_scaling=scaling)


@pytest.mark.parametrize("name", SCALINGS)
def test_inv_freq_and_attention_factor_equal_transformers(name):
    config = llama(SCALINGS[name])
    rope = ModelSpec.from_hf(config).rope
    kind = config.rope_parameters["rope_type"]
    assert rope.kind == kind
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu") if kind != "default" else (
        1.0 / (5e5 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)), 1.0)
    assert torch.equal(rope.inv_freq(), inv_freq.float())
    assert rope.attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_tables_scale_cos_and_sin_by_the_attention_factor():
    plain = Rope(theta=1e4, head_dim=8)
    yarn = Rope(theta=1e4, head_dim=8, kind="yarn", factor=4.0, original_max_position_embeddings=16,
                attention_factor=1.25)
    positions = torch.arange(5)
    freqs = torch.outer(positions.float(), yarn.inv_freq())
    cos, sin = yarn.tables(positions, torch.float32)
    torch.testing.assert_close(cos, freqs.cos() * 1.25, rtol=0, atol=0)
    torch.testing.assert_close(sin, freqs.sin() * 1.25, rtol=0, atol=0)
    assert not torch.equal(plain.tables(positions, torch.float32)[0], cos)


@pytest.mark.parametrize("name", ["default", "yarn-mscale"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_and_megatron_trainer_rotate_q_and_k_alike(name, dtype):
    """The engine's decoder (cos/sin by position, torch-op rotation) and the megatron trainer's
    core attention (per-batch tables, autograd rotation) from one spec: equal bit for bit."""
    spec = ModelSpec.from_hf(llama(SCALINGS[name]))
    heads, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    decoder = Decoder(Weights(spec, dtype))
    decoder.build_rope(spec.max_positions, torch.device("cpu"))
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 0])  # packed sequences of 4, 3 and 1 tokens
    qkv = torch.randn(len(positions), (heads + 2 * kv) * d, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k, _ = _attention_inputs(qkv, *decoder.rope_at(positions), None, None, heads, kv, spec.norm_eps)

    batch_memo.drop()
    cu_seqlens = torch.tensor([0, 4, 7, 8], dtype=torch.int32)
    cos, sin = cos_sin(spec.rope, dtype, total=len(positions), cu_seqlens=cu_seqlens)
    tq, tk, _ = qkv.split([heads * d, kv * d, kv * d], dim=-1)
    torch.testing.assert_close(apply_rope(tq.reshape(-1, heads, d), cos[:, None], sin[:, None]), q, rtol=0, atol=0)
    torch.testing.assert_close(apply_rope(tk.reshape(-1, kv, d), cos[:, None], sin[:, None]), k, rtol=0, atol=0)
    batch_memo.drop()


def test_rope_refuses_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="Rope.head_dim=7"):
        Rope(theta=1e6, head_dim=7)
    with pytest.raises(ValueError, match="Rope.theta=0"):
        Rope(theta=0, head_dim=8)
    with pytest.raises(ValueError, match="Rope.kind='dynamic'"):
        Rope(theta=1e6, head_dim=8, kind="dynamic")
    with pytest.raises(ValueError, match="Rope.original_max_position_embeddings=0 with kind='llama3'"):
        Rope(theta=1e6, head_dim=8, kind="llama3", factor=8.0)
