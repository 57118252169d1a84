"""Exact weight checksums (roles.weight_checksum): bit-exact digests over the canonical HF name
set, so trainer and engine compare equal however each lists tied weights."""

import pytest
import torch

from roles.weight_checksum import checksum_named_tensors
from tests.test_weight_sync import _InProcess


def test_checksums_are_exact_for_bfloat16_and_see_dtype_and_shape():
    t = torch.randn(4, 4).to(torch.bfloat16)
    base = checksum_named_tensors([("w", t)])["w"]
    assert checksum_named_tensors([("w", t.clone())])["w"] == base
    nudged = t.clone()
    nudged.view(torch.int16)[0, 0] += 1  # flip the lowest mantissa bit of one element
    assert checksum_named_tensors([("w", nudged)])["w"] != base
    assert checksum_named_tensors([("w", t.view(16))])["w"] != base
    assert checksum_named_tensors([("w", t.view(torch.float16))])["w"] != base
    assert checksum_named_tensors([("w", t.t())])["w"] != base  # non-contiguous is fine, differs


def test_listings_of_a_tied_model_have_one_canonical_name_set(tmp_path):
    from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm

    model = load_causal_lm(build_tiny_checkpoint(str(tmp_path / "tied"), tie_word_embeddings=True))
    params, state = list(model.named_parameters()), list(model.state_dict().items())
    assert "lm_head.weight" in dict(state) and "lm_head.weight" not in dict(params)  # the two listings differ
    assert checksum_named_tensors(params) == checksum_named_tensors(state)
    assert "lm_head.weight" not in checksum_named_tensors(state)
    # the alias listed before its target yields to the stored name
    assert checksum_named_tensors(state[::-1]) == checksum_named_tensors(params)
    # a backend that keeps a separate copy of the tied weight lists it too: same canonical set
    copied = [(n, t.clone()) for n, t in state]
    assert checksum_named_tensors(copied) == checksum_named_tensors(params)
    # an untied lm_head that differs from the embedding is checked like any tensor
    untied = dict(copied)
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    sums = checksum_named_tensors(untied.items())
    assert "lm_head.weight" in sums and sums != checksum_named_tensors(params)


@pytest.mark.timeout(120)
def test_weight_check_holds_after_a_real_sync_of_a_tied_model(tmp_path):
    """Qwen3-4B ties its embeddings: the trainer lists the shared weight once, the engine's
    state_dict twice; --check-weight-update-equal must still hold after a sync."""
    from ppo.gpu.handoffs import check_weights_equal
    from ppo.tiny_model import build_tiny_checkpoint
    from roles.rollout import EngineConfig, RolloutEngine
    from roles.trainer.config import TrainerConfig
    from roles.trainer.torch import ActorTrainer

    ckpt = build_tiny_checkpoint(str(tmp_path / "tied"), tie_word_embeddings=True)
    actor = ActorTrainer(TrainerConfig(
        hf_checkpoint=ckpt, dtype="bfloat16", seed=7, lr=1e-3, min_lr=0.0, lr_decay_style="constant",
        lr_warmup_iters=0, weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4,
        micro_batch_size=2, eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean", use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False))
    actor.onload(["params"])
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16"))
    assert actor.model.lm_head.weight is actor.model.model.embed_tokens.weight  # really tied
    with torch.no_grad():  # a policy update, as the actor's train step would make
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    before = engine.weights_checksum()
    actor.sync_weights([_InProcess(engine)], buffer_bytes=16 * 1024, version=1)
    want = actor.weights_checksum()
    assert engine.weights_checksum() == want != before
    assert "model.embed_tokens.weight" in want and "lm_head.weight" not in want

    class Job:  # what check_weights_equal reads of a job
        pass

    job = Job()
    job.actor, job.engines = _InProcess(actor), [_InProcess(engine)]
    job.actor.weights_checksum = actor.weights_checksum
    # raises on any difference; a head the sync left stale would differ from the embedding and
    # so stay in the engine's canonical listing: the check would fail
    check_weights_equal(job)
