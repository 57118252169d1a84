"""The megatron backend's parts that run without megatron-core: the config and its refusals,
the HF -> TransformerConfig mapping, packed micro-batches, chunked log-probs, and offload
by tag through pinned buffers (here: CPU storages, the same code path minus pinning)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from roles.device import DeviceMemory
from roles.trainer.batching import collate, sequences
from roles.trainer.megatron import MegatronTrainerConfig
from roles.trainer.megatron.offload import TaggedOffloader
from roles.trainer.megatron.packing import pack, plan_packed
from roles.trainer.megatron.shape import megatron_spec, transformer_config_kwargs

BASE = dict(hf_checkpoint="x", seed=0, lr=1e-6, min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0,
            weight_decay=0.0, betas=(0.9, 0.999), clip_grad=1.0, global_batch_size=4, max_tokens_per_gpu=64,
            eps_clip=0.2, value_clip=0.2, loss_agg_mode="token-mean", use_kl_loss=False, kl_loss_coef=0.0,
            kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False)

QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)


def test_recompute_flags_validated_and_mapped():
    with pytest.raises(ValueError, match="recompute_method='uniform'.*recompute_granularity is not"):
        MegatronTrainerConfig(**BASE, recompute_method="uniform")
    with pytest.raises(ValueError, match="recompute_num_layers=None, expected >= 1"):
        MegatronTrainerConfig(**BASE, recompute_granularity="full", recompute_method="uniform")
    shape = megatron_spec(Qwen3Config(**QWEN3_4B))
    kw = transformer_config_kwargs(shape, tp_size=1, pp_size=1, cp_size=1, dtype="bfloat16",
                                   recompute_granularity="full", recompute_method="block", recompute_num_layers=4)
    assert (kw["recompute_granularity"], kw["recompute_method"], kw["recompute_num_layers"]) == ("full", "block", 4)
    sel = transformer_config_kwargs(shape, tp_size=1, pp_size=1, cp_size=1, dtype="bfloat16",
                                    recompute_granularity="selective", recompute_method=None, recompute_num_layers=None)
    assert sel["recompute_granularity"] == "selective" and "recompute_method" not in sel


def test_transformer_engine_is_used_only_when_asked_for(monkeypatch, caplog):
    """transformer-engine importable does not switch its layers on: --transformer-impl does
    (default local), and the choice is logged; asked for where it does not import, refused."""
    import logging

    from roles.trainer.megatron import model

    assert MegatronTrainerConfig(**BASE).transformer_impl == "local"
    with pytest.raises(ValueError, match="transformer_impl='te', expected one of"):
        MegatronTrainerConfig(**BASE, transformer_impl="te")
    monkeypatch.setattr(model, "transformer_engine_available", lambda: True)
    with caplog.at_level(logging.INFO, logger=model.__name__):
        assert model.use_transformer_engine(MegatronTrainerConfig(**BASE).transformer_impl) is False
        assert model.use_transformer_engine("transformer_engine") is True
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "megatron layers: local spec, built-in SDPA/varlen attention", "megatron layers: transformer-engine's spec"]
    monkeypatch.setattr(model, "transformer_engine_available", lambda: False)
    with pytest.raises(RuntimeError, match="--transformer-impl transformer_engine, but transformer_engine does not"):
        model.use_transformer_engine("transformer_engine")


def test_qwen3_4b_config_maps_to_megatron_fields():
    shape = megatron_spec(Qwen3Config(**QWEN3_4B))
    assert (shape.num_kv_heads, shape.head_dim, shape.qk_norm, shape.tied_embeddings) == (8, 128, True, True)
    assert shape.rope.theta == 1e6 and shape.padded_vocab(1) == 151936
    kw = transformer_config_kwargs(shape, tp_size=2, pp_size=1, cp_size=2, dtype="bfloat16",
                                   recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    assert kw["num_query_groups"] == 8 and kw["kv_channels"] == 128 and kw["ffn_hidden_size"] == 9728
    assert kw["qk_layernorm"] and kw["gated_linear_unit"] and kw["normalization"] == "RMSNorm"
    assert kw["activation_func"] is torch.nn.functional.silu and not kw["add_qkv_bias"]
    # megatron's fused SwiGLU (bias_swiglu_impl) needs silu, a gated fc1 and no transformer-engine
    assert kw["bias_activation_fusion"] and not kw["add_bias_linear"] and not kw.get("use_te_activation_func")
    fp32 = transformer_config_kwargs(shape, tp_size=1, pp_size=1, cp_size=1, dtype="float32",
                                     recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    assert not fp32["bias_activation_fusion"]
    assert kw["params_dtype"] is torch.bfloat16 and not kw["sequence_parallel"] and kw["context_parallel_size"] == 2
    assert "recompute_granularity" not in kw


def test_llama_and_qwen2_shapes():
    llama = megatron_spec(LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=128, num_hidden_layers=2, vocab_size=100))
    assert (llama.head_dim, llama.qk_norm, llama.qkv_bias, llama.tied_embeddings) == (8, False, False, False)
    qwen2 = megatron_spec(Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=128, num_hidden_layers=2, vocab_size=100))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    with pytest.raises(ValueError, match="rope_scaling"):
        megatron_spec(LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_plan_packed_fills_by_summed_tokens():
    lengths = [10, 30, 25, 5, 40]
    plan = plan_packed(lengths, max_tokens=50)
    assert sorted(i for g in plan for i in g) == list(range(5))
    assert all(sum(lengths[i] for i in g) <= 50 for g in plan)
    assert plan == [[0, 4], [1, 3], [2]]  # first fit, longest first: 40+10, 30+5, 25
    assert plan_packed(lengths, micro_batch_size=2) == [[0, 1], [2, 3], [4]]
    assert plan_packed([70, 1], max_tokens=50) == [[0], [1]]  # too long: alone


def _batch():
    g = torch.Generator().manual_seed(0)
    prompt_lens, response_lens = torch.tensor([3, 1, 4]), torch.tensor([2, 5, 1])
    ids = torch.randint(1, 40, (3, 9), generator=g)  # inside the tiny model's vocab (47)
    return {"input_ids": ids, "prompt_lens": prompt_lens, "response_lens": response_lens,
            "loss_mask": torch.ones(3, 5), "old_log_probs": torch.randn(3, 5, generator=g)}


def test_pack_rows_predict_the_same_tokens_as_the_padded_layout():
    batch = _batch()
    seqs = sequences(batch)
    mb = pack(seqs, batch, [0, 1, 2], ("loss_mask", "old_log_probs"))
    padded = collate(seqs, batch, [0, 1, 2], ("loss_mask", "old_log_probs"))
    assert mb.cu_seqlens.tolist() == [0, 5, 11, 16] and mb.max_seqlen == 6
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]
    # row k of the packed layout predicts the token response token r of sample i sits at
    for k in range(len(mb.rows)):
        i, r = int(mb.row_sample[k]), int(mb.row_offset[k])
        assert mb.input_ids[mb.rows[k] + 1] == padded.input_ids[i, padded.prompt_lens[i] + r] == mb.targets[k]
    assert torch.equal(mb.valid, padded.valid)
    flat = torch.arange(len(mb.rows), dtype=torch.float32) + 1
    rows = mb.to_rows(flat)
    assert rows.shape == (3, 5) and rows[2, 1:].eq(0).all() and rows[1].tolist() == [3, 4, 5, 6, 7]


def test_offloader_frees_storages_restores_views_and_accounts():
    memory = DeviceMemory("actor")
    flat = torch.arange(12, dtype=torch.float32)
    views = [flat[:5], flat[5:]]  # like parameters viewing DDP's param buffer
    grads = torch.ones(4)
    off = TaggedOffloader(memory)
    off.register("params", lambda: views)
    off.register("grads", lambda: [grads], keep=False)
    memory.account("params", off.nbytes("params"))
    report = off.offload("params")
    assert report["bytes"] == 48 and flat.untyped_storage().nbytes() == 0 and "params" not in memory.ledger()
    assert off.nbytes("params") == 48
    onload = off.onload("params")
    assert onload["bytes"] == 48 and 0 <= onload["alloc_seconds"] <= onload["seconds"]  # allocating is part of it
    assert torch.equal(views[1], torch.arange(5, 12, dtype=torch.float32)) and memory.ledger()["params"] == 48
    assert "params" not in off._host  # the construction-time offload's block is freed at its onload
    off.offload("params")
    block = off._host["params"]
    assert block.nbytes == 48 and block.sizes == [48]  # one block of exactly the tag's bytes
    off.onload("params")
    assert off._host["params"] is block  # kept from the second offload on
    off.offload("params")
    assert off._host["params"] is block  # and reused, not reallocated
    off.onload("params")
    assert off.offload("grads")["bytes"] == 0  # grads are freed, not copied
    off.onload("grads")
    assert torch.equal(grads, torch.zeros(4))


def test_a_tag_registered_keep_first_keeps_its_construction_time_block():
    """The params of a run that offloads them every iteration keep the host block of the
    construction-time offload (their sizes never change); without keep_first it is freed."""
    kept, freed = torch.arange(8.0), torch.arange(8.0)
    off = TaggedOffloader(DeviceMemory("actor"))
    off.register("params", lambda: [kept], keep_first=True)
    off.register("optimizer", lambda: [freed])
    for tag in ("params", "optimizer"):
        off.offload(tag)
    first = off._host["params"]
    for tag in ("params", "optimizer"):
        off.onload(tag)
    assert off._host["params"] is first and "optimizer" not in off._host
    with torch.no_grad():
        kept += 1
    off.offload("params")
    assert off._host["params"] is first  # written again, not reallocated
    off.onload("params")
    assert torch.equal(kept, torch.arange(8.0) + 1)
    cfg = MegatronTrainerConfig.from_dict({**BASE, "offload_tags": ["params", "grads"]})  # a list from plain values
    assert cfg.offload_tags == ("params", "grads")
    with pytest.raises(ValueError, match=r"offload_tags=\('weights',\), expected tags among"):
        MegatronTrainerConfig(**BASE, offload_tags=("weights",))


def test_offloader_replaces_its_host_block_when_new_state_appears():
    """Adam's moments appear at the first step: the tag's host block is replaced by one of the
    new exact size (the old one freed), and every storage round-trips through its view."""
    memory = DeviceMemory("actor")
    main, moments = [torch.arange(6.0)], []
    off = TaggedOffloader(memory)
    off.register("optimizer", lambda: main + moments)
    for _ in range(2):  # past the construction-time offload
        off.offload("optimizer")
        off.onload("optimizer")
    old = off._host["optimizer"]
    moments += [torch.ones(3), torch.full((3,), 2.0)]
    off.offload("optimizer")
    block = off._host["optimizer"]
    assert block is not old and old.views == [] and block.sizes == [24, 12, 12] and block.nbytes == 48
    off.onload("optimizer")
    assert torch.equal(main[0], torch.arange(6.0)) and torch.equal(moments[1], torch.full((3,), 2.0))
    off.offload("optimizer")
    assert off._host["optimizer"] is block  # same sizes: reused


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "sum-of-sample-mean"])
def test_megatron_losses_equal_the_torch_backends_on_the_same_log_probs(ckpt, agg):
    """The megatron roles' policy and value objectives (trainer.py) against the torch
    backend's _micro_loss, fed the same model outputs: packed rows vs padded rows."""
    from roles.trainer import TrainerConfig
    from roles.trainer.torch import ActorTrainer, CriticTrainer
    from roles.trainer.megatron.trainer import MegatronActorTrainer, MegatronCriticTrainer
    from roles.trainer.torch.model import policy_log_probs, values_forward
    from roles.trainer.sharding import aggregation_counts

    over = dict(hf_checkpoint=ckpt, dtype="float32", loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.1,
                keep_ref=True, entropy_coef=0.01)
    torch_actor = ActorTrainer(TrainerConfig(**{**BASE, **over}))
    meg_actor = object.__new__(MegatronActorTrainer)  # the objective only reads .config
    meg_actor.config = MegatronTrainerConfig(**{**BASE, **over})
    batch = _batch()
    g = torch.Generator().manual_seed(3)
    batch.update(advantages=torch.randn(3, 5, generator=g), ref_log_probs=torch.randn(3, 5, generator=g) - 3,
                 old_values=torch.randn(3, 5, generator=g), returns=torch.randn(3, 5, generator=g))
    keys = ("loss_mask", "old_log_probs", "advantages", "ref_log_probs")
    seqs = sequences(batch)
    padded, packed = collate(seqs, batch, [0, 1, 2], keys), pack(seqs, batch, [0, 1, 2], keys)
    counts = aggregation_counts(padded.valid, agg)
    with torch.no_grad():
        lp, ent = policy_log_probs(torch_actor.model, padded, temperature=1.0, dtype=torch.float32, with_entropy=True)
        expect_loss, expect = torch_actor._micro_loss(padded, counts)
    flat = (lp[packed.row_sample, packed.row_offset], ent[packed.row_sample, packed.row_offset])
    loss, metrics = meg_actor.loss(flat, packed, counts)
    torch.testing.assert_close(loss, expect_loss)
    assert set(metrics) == set(expect)
    for k in expect:
        torch.testing.assert_close(metrics[k].float(), torch.as_tensor(expect[k]).float(), msg=k)

    critic_keys = ("loss_mask", "old_values", "returns")
    torch_critic = CriticTrainer(TrainerConfig(**{**BASE, **over, "keep_ref": False, "use_kl_loss": False}))
    meg_critic = object.__new__(MegatronCriticTrainer)
    meg_critic.config = MegatronTrainerConfig(**{**BASE, **over, "keep_ref": False, "use_kl_loss": False})
    padded, packed = collate(seqs, batch, [0, 1, 2], critic_keys), pack(seqs, batch, [0, 1, 2], critic_keys)
    with torch.no_grad():
        values = values_forward(torch_critic.model, padded, dtype=torch.float32)
        expect_loss, expect = torch_critic._micro_loss(padded, counts)
    loss, metrics = meg_critic.loss((values[packed.row_sample, packed.row_offset],), packed, counts)
    torch.testing.assert_close(loss, expect_loss)
    for k in expect:
        torch.testing.assert_close(metrics[k].float(), torch.as_tensor(expect[k]).float(), msg=k)


def test_sync_views_are_mapped_once_per_set_of_parameter_storages(monkeypatch):
    """MegatronCore.named_hf_weights(views=True) at TP1 on one stage maps once and reuses the
    list across syncs and offloads (resize_ keeps the storage), and maps again when a
    parameter storage is replaced; other calls map every time."""
    from roles.trainer.megatron.core import MegatronCore

    core = object.__new__(MegatronCore)  # only the fields named_hf_weights reads
    core.tp_group = core.pp_group = core._sync_views = None
    buffer = [torch.arange(6.0)]
    mapped = []

    def hf_weights(views):
        mapped.append(views)
        return iter([("w", buffer[0][:3]), ("b", buffer[0][3:])])

    monkeypatch.setattr(core, "_param_tensors", lambda: buffer, raising=False)
    monkeypatch.setattr(core, "_hf_weights", hf_weights, raising=False)
    first = list(core.named_hf_weights(views=True))
    buffer[0].untyped_storage().resize_(0)  # an offload, then the onload
    buffer[0].untyped_storage().resize_(6 * 4)
    buffer[0].copy_(torch.arange(6.0) * 2)  # a train step writes in place
    again = list(core.named_hf_weights(views=True))
    assert mapped == [True] and torch.equal(again[1][1], torch.tensor([6.0, 8.0, 10.0]))
    assert [n for n, _ in first] == [n for n, _ in again]
    list(core.named_hf_weights())  # checksums, save_hf: mapped each time, never cached
    assert mapped == [True, False]
    buffer[0] = torch.arange(6.0) + 100  # a new storage (e.g. a rebuilt DDP buffer)
    renewed = dict(core.named_hf_weights(views=True))
    assert mapped == [True, False, True] and renewed["w"][0] == 100.0
    core.tp_group = object()  # at TP2 the pairs are gathered copies: mapped every sync
    list(core.named_hf_weights(views=True))
    assert mapped == [True, False, True, True]
