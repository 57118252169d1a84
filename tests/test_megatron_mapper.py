"""HF <-> megatron weight mapper (roles.trainer.megatron.mapper), pure torch on state dicts.

The reference below builds megatron shards with plain loops over heads, groups and rows,
independently of the mapper's reshapes; the round trip must be bit-identical for several
TP/PP sizes, for Qwen3 (qk-norm, tied), Llama (untied) and Qwen2 (qkv bias), and the critic.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from roles.trainer.megatron.mapper import hf_to_megatron, megatron_names, megatron_to_hf, to_hf
from roles.trainer.megatron.shape import megatron_spec
from roles.trainer.torch.model import ValueModel
from roles.weight_sync import is_window

SMALL = dict(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)


def qwen3_config(tied: bool = True) -> Qwen3Config:
    return Qwen3Config(**SMALL, head_dim=8, tie_word_embeddings=tied)


def hf_state(config, critic: bool = False) -> dict[str, torch.Tensor]:
    """A real HF model's state dict (random init), so every name is one transformers uses."""
    torch.manual_seed(0)
    if critic:
        model = ValueModel(AutoModel.from_config(config), seed=0)
    else:
        model = AutoModelForCausalLM.from_config(config)
    state = {}
    for name, p in model.named_parameters():  # named_parameters lists a tied weight once
        state[name] = p.detach().clone().normal_()  # distinct values everywhere
    return state


def reference_qkv(hf, layer, shape, tp_rank, tp_size, prefix="model."):
    """linear_qkv of one TP rank, row by row: for each of the rank's query groups, its q
    heads, its k head, its v head."""
    d = shape.head_dim
    qpg = shape.num_heads // shape.num_kv_heads
    groups_per_rank = shape.num_kv_heads // tp_size
    q = hf[f"{prefix}layers.{layer}.self_attn.q_proj.weight"]
    k = hf[f"{prefix}layers.{layer}.self_attn.k_proj.weight"]
    v = hf[f"{prefix}layers.{layer}.self_attn.v_proj.weight"]
    rows = []
    for g in range(tp_rank * groups_per_rank, (tp_rank + 1) * groups_per_rank):
        for h in range(g * qpg, (g + 1) * qpg):
            rows += [q[h * d + i] for i in range(d)]
        rows += [k[g * d + i] for i in range(d)]
        rows += [v[g * d + i] for i in range(d)]
    return torch.stack(rows)


def reference_fc1(hf, layer, shape, tp_rank, tp_size, prefix="model."):
    f = shape.intermediate_size // tp_size
    gate = hf[f"{prefix}layers.{layer}.mlp.gate_proj.weight"]
    up = hf[f"{prefix}layers.{layer}.mlp.up_proj.weight"]
    return torch.stack([gate[tp_rank * f + i] for i in range(f)] + [up[tp_rank * f + i] for i in range(f)])


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
def test_qwen3_round_trip_is_bit_identical_and_matches_reference(tp, pp):
    config = qwen3_config()
    shape = megatron_spec(config)
    hf = hf_state(config)
    states = [[hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=s, pp_size=pp) for t in range(tp)]
              for s in range(pp)]
    per_stage = shape.num_layers // pp
    for s in range(pp):
        for t in range(tp):
            st = states[s][t]
            for i in range(per_stage):
                layer = s * per_stage + i
                assert torch.equal(st[f"decoder.layers.{i}.self_attention.linear_qkv.weight"],
                                   reference_qkv(hf, layer, shape, t, tp))
                assert torch.equal(st[f"decoder.layers.{i}.mlp.linear_fc1.weight"], reference_fc1(hf, layer, shape, t, tp))
                o = hf[f"model.layers.{layer}.self_attn.o_proj.weight"]
                cols = o.shape[1] // tp
                assert torch.equal(st[f"decoder.layers.{i}.self_attention.linear_proj.weight"],
                                   o[:, t * cols:(t + 1) * cols])
                assert torch.equal(st[f"decoder.layers.{i}.self_attention.q_layernorm.weight"],
                                   hf[f"model.layers.{layer}.self_attn.q_norm.weight"])
            if s == 0:
                emb = st["embedding.word_embeddings.weight"]
                rows = shape.padded_vocab(tp) // tp
                assert emb.shape[0] == rows
                expect = torch.cat([hf["model.embed_tokens.weight"],
                                    torch.zeros(shape.padded_vocab(tp) - shape.vocab_size, shape.hidden_size)])
                assert torch.equal(emb, expect[t * rows:(t + 1) * rows])
            # tied: only a pipelined last stage holds its own output layer (megatron's shared copy)
            assert ("output_layer.weight" in st) == (s == pp - 1 and pp > 1)
    back = megatron_to_hf(states, shape)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_a_gathered_embedding_owns_its_memory_and_a_single_shard_stays_a_view():
    """At TP>1 the vocab trim of the gathered embedding is copied: a slice of the gather would
    pass for a window into the param buffer, and a direct weight sync would keep the whole
    gather alive unaccounted. At TP1 it stays a view of the parameter (megatron's buffer)."""
    config = Qwen3Config(**{**SMALL, "vocab_size": 251}, head_dim=8)  # padded to 252 at TP2
    shape = megatron_spec(config)
    hf = hf_state(config)
    name = "embedding.word_embeddings.weight"
    shards = [hf_to_megatron(hf, shape, tp_rank=t, tp_size=2, pp_rank=0, pp_size=1)[name] for t in range(2)]
    assert sum(s.shape[0] for s in shards) > shape.vocab_size  # the trim is a real slice
    [(hf_name, gathered)] = to_hf(name, shards, shape, layer_offset=0)
    assert torch.equal(gathered, hf[hf_name]) and not is_window(gathered)

    [shard] = [hf_to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)[name]]
    buffer = torch.zeros(shard.numel() + 64)  # the param as a window of a larger flat buffer
    param = buffer[: shard.numel()].view(shard.shape).copy_(shard)
    [(_, single)] = to_hf(name, [param], shape, layer_offset=0)
    assert torch.equal(single, hf[hf_name]) and is_window(single)
    assert single.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


@pytest.mark.parametrize("config,tp,pp", [
    (LlamaConfig(**SMALL, tie_word_embeddings=False), 2, 2),
    (Qwen2Config(**SMALL, tie_word_embeddings=False), 4, 1),
    (qwen3_config(tied=False), 2, 4),
])
def test_dense_models_round_trip(config, tp, pp):
    shape = megatron_spec(config)
    hf = hf_state(config)
    states = [[hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=s, pp_size=pp) for t in range(tp)]
              for s in range(pp)]
    if shape.qkv_bias:  # Qwen2: biases fused per group as the weights are
        bias = states[0][1]["decoder.layers.0.self_attention.linear_qkv.bias"]
        d, qpg = shape.head_dim, shape.heads_per_group
        q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv")
        g = shape.num_kv_heads // tp  # first group of TP rank 1
        assert torch.equal(bias[: qpg * d], q[g * qpg * d:(g + 1) * qpg * d])
        assert torch.equal(bias[qpg * d:(qpg + 1) * d], k[g * d:(g + 1) * d])
    assert torch.equal(states[-1][0]["output_layer.weight"], hf["lm_head.weight"].chunk(tp)[0])
    back = megatron_to_hf(states, shape)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_critic_round_trip_with_value_head(tp, pp):
    config = qwen3_config()
    shape = megatron_spec(config)
    hf = hf_state(config, critic=True)
    states = [[hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=s, pp_size=pp, critic=True)
               for t in range(tp)] for s in range(pp)]
    last = states[-1][0]
    assert last["output_layer.weight"].shape == (1, shape.hidden_size)  # replicated, not vocab-split
    assert torch.equal(last["output_layer.bias"], hf["value_head.bias"])
    assert torch.equal(states[0][tp - 1]["decoder.layers.0.self_attention.linear_qkv.weight"],
                       reference_qkv(hf, 0, shape, tp - 1, tp, prefix="backbone."))
    back = megatron_to_hf(states, shape, critic=True)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)


def test_te_spec_names_the_fused_norms():
    shape = megatron_spec(qwen3_config())
    local = megatron_names(shape, pp_rank=0, pp_size=1)
    te = megatron_names(shape, pp_rank=0, pp_size=1, spec="te")
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te
    hf = hf_state(qwen3_config())
    back = megatron_to_hf([[hf_to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, spec="te")]],
                          shape, spec="te")
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_unsupported_shapes_are_refused_with_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        hf_to_megatron(hf_state(qwen3_config()), megatron_spec(qwen3_config()), tp_rank=0, tp_size=8,
                       pp_rank=0, pp_size=1)
    with pytest.raises(ValueError, match="num_hidden_layers=4"):
        megatron_spec(qwen3_config()).check_parallel(tp_size=1, pp_size=3)
    with pytest.raises(ValueError, match="model_type='gpt2' is not supported"):
        megatron_spec({"model_type": "gpt2"})


def test_a_checkpoint_tensor_with_no_place_is_refused_by_name_unless_the_arch_drops_it():
    """A Qwen2-style q bias in a Qwen3 checkpoint (no biases) is refused with its name, not
    dropped; RoPE's saved inv_freq and a tied checkpoint's stored lm_head copy are on the
    list of tensors the architecture ignores (roles.model_spec.ModelSpec.ignores)."""
    config = qwen3_config()
    shape = megatron_spec(config)
    hf = hf_state(config)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].clone()
    stage = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=2)  # layers 0 and 1
    assert set(hf_to_megatron(hf, shape, **stage)) == set(megatron_names(shape, pp_rank=0, pp_size=2))
    hf["model.layers.3.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model\.layers\.3\.self_attn\.q_proj\.bias' has no "
                                         r"place in the qwen3 model .*qkv_bias=False"):
        hf_to_megatron(hf, shape, **stage)  # a stage without layer 3 refuses it too: the whole model has none
    untied = qwen3_config(tied=False)
    hf = hf_state(untied)
    hf["score.weight"] = torch.zeros(1, 32)
    with pytest.raises(ValueError, match=r"'score\.weight' has no place"):
        hf_to_megatron(hf, megatron_spec(untied), tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
