"""The megatron backend on a GPU (`bash .ci/gpu -k megatron`): needs CUDA and megatron-core.

Same tiny Qwen3 checkpoint and batch through the torch backend and the megatron backend:
log-probs, values, one PPO/value update; the mapper's round trip on a real GPTModel; the
varlen attention path against the per-sequence reference; offload/onload on the device.
Token ids avoid 0, the tiny model's pad token: HF's embedding never updates its padding_idx
row and megatron's does, so a batch with it would differ in that row's gradient alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

megatron = pytest.importorskip("megatron.core") if torch.cuda.is_available() else None


def trainer_config(ckpt: str, **over) -> dict:
    """The field values both backends' trainers are built from here (TrainerConfig.from_dict,
    MegatronTrainerConfig.from_dict)."""
    cfg = dict(hf_checkpoint=ckpt, seed=0, dtype="bfloat16", lr=1e-4, min_lr=0.0, lr_decay_style="constant",
               lr_warmup_iters=0, weight_decay=0.0, betas=(0.9, 0.999), clip_grad=1.0, global_batch_size=4,
               max_tokens_per_gpu=64, eps_clip=0.2, value_clip=0.2, loss_agg_mode="token-mean", use_kl_loss=False,
               kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=True)
    cfg.update(over)
    return cfg


def make_batch(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens = torch.tensor([5, 3, 4, 2]), torch.tensor([6, 2, 5, 3])
    ids = torch.randint(1, vocab, (4, 11), generator=g)
    return {"input_ids": ids, "prompt_lens": prompt_lens, "response_lens": response_lens,
            "loss_mask": torch.ones(4, 6)}


@pytest.fixture(scope="module")
def pair(ckpt):
    from transformers import AutoConfig

    from roles.trainer import TrainerConfig
    from roles.trainer.megatron import MegatronActorTrainer, MegatronTrainerConfig
    from roles.trainer.torch import ActorTrainer

    cfg = trainer_config(ckpt)
    meg = MegatronActorTrainer(MegatronTrainerConfig.from_dict(cfg))
    ref = ActorTrainer(TrainerConfig.from_dict(cfg))
    return meg, ref, AutoConfig.from_pretrained(ckpt).vocab_size


def test_mapper_round_trip_on_a_real_gptmodel(pair, ckpt):
    from roles.trainer.megatron.env import load_hf_state

    meg, _, _ = pair
    meg.onload(["params"])
    hf = load_hf_state(ckpt)
    back = dict(meg.named_weights())
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name].cpu(), tensor.to(torch.bfloat16)), name


def test_log_probs_and_one_update_match_the_torch_backend(pair):
    meg, ref, vocab = pair
    batch = make_batch(vocab)
    meg.onload(["params"])
    ref.onload(["params"])
    lp_meg = meg.compute_log_probs(batch)["log_probs"]
    lp_ref = ref.compute_log_probs(batch)["log_probs"]
    torch.testing.assert_close(lp_meg, lp_ref, rtol=0.0, atol=0.05)  # bf16 weights vs bf16 autocast
    g = torch.Generator().manual_seed(1)
    train = {**batch, "old_log_probs": lp_ref, "advantages": torch.randn(4, 6, generator=g)}
    meg.onload(["grads", "optimizer"])
    ref.onload(["optimizer"])
    m_meg, m_ref = meg.train(train), ref.train(train)
    assert m_meg["skipped_nonfinite"] == 0
    assert m_meg["pg_loss"] == pytest.approx(m_ref["pg_loss"], abs=0.02)
    assert m_meg["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=0.05)
    after = meg.compute_log_probs(batch)["log_probs"]
    assert (after - lp_meg).abs().max() > 1e-3  # the update moved the policy
    torch.testing.assert_close(after, ref.compute_log_probs(batch)["log_probs"], rtol=0.0, atol=0.08)
    # the reference stays at the initial weights while the policy moved (before the update the
    # two are equal, so only a comparison after it tells a swap that did nothing), and the
    # swap puts the trained weights back
    torch.testing.assert_close(meg.compute_ref_log_probs(batch)["log_probs"], lp_meg, rtol=0.0, atol=1e-5)
    torch.testing.assert_close(meg.compute_log_probs(batch)["log_probs"], after, rtol=0.0, atol=1e-5)


def test_tiny_ppos_own_objective_updates_alike_in_both_backends(ckpt):
    """tiny_ppo's actor settings as its run resolves them (ppo.setup.role_configs.trainer_config: its
    loss_agg_mode, the low_var_kl loss at 0.1 against the reference, lr 2e-3, weight decay),
    with two micro-batches a step: three updates in each backend stay together. The pair above
    checks token-mean without a KL loss; tiny_ppo's own objective is where the two backends'
    steps would part if they differ."""
    from transformers import AutoConfig

    from ppo.config.serialize import override
    from ppo.config.validate import ensure_valid
    from ppo.setup.role_configs import trainer_config as run_trainer_config
    from ppo.config.recipes import tiny_ppo
    from roles.trainer.megatron import MegatronActorTrainer, MegatronTrainerConfig
    from roles.trainer.torch import ActorTrainer

    run = ensure_valid(override(tiny_ppo(), global_batch_size=4, micro_batch_size=2))
    cfg = run_trainer_config(run, ckpt, critic=False, dtype="bfloat16")  # tiny_ppo trains on torch
    assert cfg.use_kl_loss and cfg.kl_loss_type == "low_var_kl" and cfg.keep_ref
    meg = MegatronActorTrainer(MegatronTrainerConfig.from_dict(dataclasses.asdict(cfg)))
    ref = ActorTrainer(cfg)
    meg.onload(["params", "grads", "optimizer"])
    ref.onload(["params", "optimizer"])
    batch = make_batch(AutoConfig.from_pretrained(ckpt).vocab_size, seed=6)
    g = torch.Generator().manual_seed(7)
    advantages = torch.randn(4, 6, generator=g)
    lp_ref = ref.compute_log_probs(batch)["log_probs"]
    for update in range(3):
        old = ref.compute_log_probs(batch)["log_probs"]
        train = {**batch, "old_log_probs": old, "advantages": advantages,
                 "ref_log_probs": ref.compute_ref_log_probs(batch)["log_probs"]}
        m_meg, m_ref = meg.train(train), ref.train(train)
        assert m_meg["skipped_nonfinite"] == 0, update
        # a scale slip (micro-batches, sample means, the KL term) shows at once in the grad norm;
        # the CPU's torch run of this moves log-probs by ~1.6 and the KL loss to ~0.6 in 3 updates,
        # so the backends' bf16 roundings may drift apart by a few percent of that
        for key, tol in (("pg_loss", dict(abs=0.03)), ("kl_loss", dict(rel=0.1, abs=2e-3)), ("grad_norm", dict(rel=0.1))):
            assert m_meg[key] == pytest.approx(m_ref[key], **tol), (update, key, m_meg[key], m_ref[key])
        torch.testing.assert_close(meg.compute_log_probs(batch)["log_probs"], ref.compute_log_probs(batch)["log_probs"],
                                   rtol=0.0, atol=0.15)
    assert (ref.compute_log_probs(batch)["log_probs"] - lp_ref).abs().max() > 0.5  # the updates moved the policy
    # weight decay as the torch backend's: none on biases and 1-D weights (norms), the config's
    # on the rest; megatron leaves wd_mult to an lr scheduler, so every group decayed at first
    groups = [g for g in meg._core.optimizer.param_groups if g["params"]]
    assert {(g["wd_mult"], g["weight_decay"]) for g in groups} == {(0.0, 0.0), (1.0, cfg.weight_decay)}
    undecayed = sum(p.numel() for g in groups if g["wd_mult"] == 0.0 for p in g["params"])
    assert undecayed == sum(p.numel() for p in meg._core.module.parameters() if p.dim() == 1)
    meg.offload(["params", "grads", "optimizer"])
    ref.offload(["params", "optimizer"])


def test_both_backends_refuse_a_rank_plan_with_a_step_of_no_rows(pair):
    """The one-row check of roles.trainer.steps, on a real megatron trainer as on the torch one,
    before any micro-batch runs (the weights stay as they were)."""
    meg, ref, vocab = pair
    batch = make_batch(vocab, seed=5)
    train = {**batch, "old_log_probs": torch.zeros(4, 6), "advantages": torch.ones(4, 6)}
    plan = [{"num_samples": k, "global_batch_size": 8, "global_token_count": 32} for k in (0, 4)]
    meg.onload(["params", "grads", "optimizer"])
    ref.onload(["params", "optimizer"])
    before = meg.compute_log_probs(batch)["log_probs"]
    for trainer in (meg, ref):
        with pytest.raises(ValueError, match="at least one row each"):
            trainer.train(train, mini_batches=plan)
    assert torch.equal(meg.compute_log_probs(batch)["log_probs"], before)


def test_offload_frees_the_device_and_onload_restores(pair):
    meg, ref, vocab = pair
    ref.offload(["params", "optimizer"])
    batch = make_batch(vocab, seed=2)
    meg.onload(["params", "grads", "optimizer"])
    before = meg.compute_log_probs(batch)["log_probs"]
    report = meg.offload(["params", "grads", "optimizer"])
    assert report["ledger"] == {}
    assert report["moves"]["params"]["bytes"] > 0 and report["moves"]["grads"]["bytes"] == 0
    back = meg.onload(["params", "grads", "optimizer"])
    assert back["moves"]["params"]["bytes"] == report["moves"]["params"]["bytes"]
    assert torch.equal(meg.compute_log_probs(batch)["log_probs"], before)


def test_critic_values_match_the_torch_backend(ckpt):
    from roles.trainer import TrainerConfig
    from roles.trainer.megatron import MegatronCriticTrainer, MegatronTrainerConfig
    from roles.trainer.torch import CriticTrainer

    cfg = trainer_config(ckpt, keep_ref=False)
    meg = MegatronCriticTrainer(MegatronTrainerConfig.from_dict(cfg))
    ref = CriticTrainer(TrainerConfig.from_dict(cfg))
    meg.onload(["params", "grads", "optimizer"])
    ref.onload(["params", "optimizer"])
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(ckpt).vocab_size, seed=3)
    v_meg, v_ref = meg.compute_values(batch)["values"], ref.compute_values(batch)["values"]
    torch.testing.assert_close(v_meg, v_ref, rtol=0.0, atol=0.05)
    g = torch.Generator().manual_seed(4)
    train = {**batch, "old_values": v_ref, "returns": torch.randn(4, 6, generator=g)}
    m_meg, m_ref = meg.train(train), ref.train(train)
    assert m_meg["value_loss"] == pytest.approx(m_ref["value_loss"], rel=0.02)
    assert m_meg["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=0.05)
    meg.offload(["params", "grads", "optimizer"])
    ref.offload(["params", "optimizer"])


def test_varlen_attention_matches_the_per_sequence_reference():
    from roles.trainer.megatron.attention import attend_packed, varlen_usable

    g = torch.Generator(device="cuda").manual_seed(0)
    seqlens = [37, 1, 128, 300]
    cu = torch.tensor([0] + seqlens).cumsum(0)
    q = torch.randn(sum(seqlens), 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(seqlens), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(seqlens), 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    assert varlen_usable(q), "torch.nn.attention.varlen is missing on this GPU build"
    fast = attend_packed(q, k, v, cu, cu, max(seqlens), max(seqlens), scale=0.125)
    slow = attend_packed(q, k, v, cu, cu, max(seqlens), max(seqlens), scale=0.125, reference=True)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=0.0, atol=2e-2)
    # query tails shorter than their key segments (the CP chunks): bottom-right alignment
    cu_q = torch.tensor([0, 10, 20])
    cu_k = torch.tensor([0, 37, 165])
    fast = attend_packed(q[:20], k[:165], v[:165], cu_q, cu_k, 10, 128, scale=0.125)
    slow = attend_packed(q[:20], k[:165], v[:165], cu_q, cu_k, 10, 128, scale=0.125, reference=True)
    torch.testing.assert_close(fast.float(), slow.float(), rtol=0.0, atol=2e-2)
