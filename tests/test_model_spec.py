"""roles.model_spec: one reading of the HF config (both transformers spellings of RoPE) and
every refusal, each naming the config field and its value."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen2Config, Qwen3Config

from ppo.tiny_model import EOS_ID, build_tiny_checkpoint
from roles.model_spec import ModelSpec
from roles.rope import Rope

BASE = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=2, vocab_size=100, max_position_embeddings=512, rms_norm_eps=1e-5)
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=128)
YARN = dict(factor=4.0, original_max_position_embeddings=128, beta_fast=16)


@pytest.mark.parametrize("kind, scaling", [("llama3", LLAMA3), ("yarn", YARN), ("linear", dict(factor=2.0))])
def test_transformers_4_and_5_spellings_give_one_spec(kind, scaling):
    v5 = ModelSpec.from_hf({**BASE, "rope_parameters": {"rope_type": kind, "rope_theta": 5e5, **scaling}})
    v4 = ModelSpec.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": kind, **scaling}})
    v4_old_key = ModelSpec.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {"type": kind, **scaling}})
    assert v5 == v4 == v4_old_key
    assert v5.rope.kind == kind and v5.rope.theta == 5e5 and v5.rope.factor == scaling["factor"]


def test_plain_rope_in_both_spellings_and_the_default_theta():
    v5 = ModelSpec.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    v4 = ModelSpec.from_hf({**BASE, "rope_theta": 1e6, "rope_scaling": None})
    assert v5 == v4 and v5.rope == Rope(theta=1e6, head_dim=16)
    assert ModelSpec.from_hf(BASE).rope.theta == 10000.0


def test_scaling_defaults_as_transformers_defaults_them():
    # llama3/yarn without original_max_position_embeddings: the config's max_position_embeddings
    spec = ModelSpec.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert spec.rope.original_max_position_embeddings == 512
    assert (spec.rope.beta_fast, spec.rope.beta_slow, spec.rope.truncate) == (32.0, 1.0, True)
    assert spec.rope.attention_factor == pytest.approx(0.1 * 1.3862943611198906 + 1)  # 0.1 ln(4) + 1
    given = ModelSpec.from_hf({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0}})
    assert given.rope.attention_factor == 1.0


def test_shapes_of_the_families():
    qwen3 = ModelSpec.from_hf(Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=128, num_hidden_layers=2, vocab_size=100))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias) == (128, True, False)  # Qwen3Config's head_dim
    qwen2 = ModelSpec.from_hf(Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=128, num_hidden_layers=2, vocab_size=100))
    assert (qwen2.head_dim, qwen2.qk_norm, qwen2.qkv_bias) == (16, False, True)
    llama = ModelSpec.from_hf(BASE)
    assert (llama.num_kv_heads, llama.heads_per_group, llama.norm_eps, llama.tied_embeddings) == (2, 2, 1e-5, False)
    assert llama.kv_elements_per_token == 2 * 2 * 2 * 16 and llama.padded_vocab(3) == 102


@pytest.mark.parametrize("fields, match", [
    ({"model_type": "gpt2"}, r"model_type='gpt2' is not supported; supported: \('qwen3'"),
    ({"hidden_act": "gelu"}, "llama with hidden_act='gelu' is not supported"),
    ({"use_sliding_window": True}, "llama with use_sliding_window=True is not supported"),
    ({"mlp_bias": True}, "llama with mlp_bias=True is not supported"),
    ({"partial_rotary_factor": 0.5}, "llama with partial_rotary_factor=0.5 is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_parameters: rope_type='dynamic' is not supported; supported: \('default', 'linear', 'llama3', 'yarn'\)"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}},
     "rope_scaling: rope_type='longrope' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling: rope_type='llama3' needs 'low_freq_factor'"),
    ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters: rope_type='linear' needs 'factor'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_parameters: partial_rotary_factor=0.5 is not supported"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}},
     r"rope_parameters per layer type \(\['full_attention'\]\) is not supported"),
    ({"num_hidden_layers": None}, "the HF config lacks 'num_hidden_layers'"),
])
def test_every_refusal_names_the_field_and_value(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf({**BASE, **fields})


def test_backend_refusals_name_the_numbers():
    spec = ModelSpec.from_hf({**BASE, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    with pytest.raises(ValueError,
                       match=r"megatron backend: llama with RoPE scaling rope_type='linear' \(rope_parameters"):
        spec.check_plain_rope("megatron backend")
    ModelSpec.from_hf(BASE).check_plain_rope("megatron backend")
    with pytest.raises(ValueError, match="tensor_model_parallel_size=4 must divide num_key_value_heads=2"):
        spec.check_parallel(tp_size=4, pp_size=1)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=3 must divide num_hidden_layers=2"):
        spec.check_parallel(tp_size=1, pp_size=3)


def test_unplaced_checkpoint_tensors_are_refused_by_name_but_the_ignored_ones():
    spec, placed = ModelSpec.from_hf(BASE), {"model.norm.weight"}
    spec.refuse_unplaced(["model.norm.weight", "model.layers.3.self_attn.rotary_emb.inv_freq"], placed,
                         loader="L")
    with pytest.raises(ValueError, match=r"L: checkpoint tensor 'model.layers.0.mlp.up_proj.bias' has no place "
                                         r"in the llama model"):
        spec.refuse_unplaced(["model.norm.weight", "model.layers.0.mlp.up_proj.bias"], placed, loader="L")
    with pytest.raises(ValueError, match="'model.rotary_emb.inv_freq_extra'"):  # the list is exact names
        spec.refuse_unplaced(["model.rotary_emb.inv_freq_extra"], placed, loader="L")


def test_from_checkpoint_reads_config_and_generation_eos(tmp_path):
    ckpt = build_tiny_checkpoint(str(tmp_path / "tiny"))
    spec = ModelSpec.from_checkpoint(ckpt)
    assert spec.model_type == "qwen3" and spec.eos_ids == (EOS_ID,) and spec.head_dim == 16
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    (tmp_path / "tiny" / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="model_type='gpt_neox' is not supported"):
        ModelSpec.from_checkpoint(ckpt)
