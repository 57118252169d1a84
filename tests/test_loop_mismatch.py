"""The driver's side of TIS: weights and metrics from the batch, custom functions, and what the
actor is sent (--use-rollout-logprobs)."""

import pytest
import torch

from algorithms import masked_is
from ppo.config import override
from ppo.loop import actor_batch, mismatch_correction
from ppo.setup.user_functions import load_user_functions
from ppo.config.recipes import tiny_ppo


def batch():
    gen = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 5, generator=gen)
    old = rollout + 0.5 * torch.randn(4, 5, generator=gen)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    return {"input_ids": torch.zeros(4, 8, dtype=torch.long), "prompt_lens": torch.full((4,), 3),
            "response_lens": torch.tensor([5, 3, 5, 5]), "loss_mask": mask, "old_log_probs": old,
            "rollout_log_probs": rollout, "advantages": torch.randn(4, 5, generator=gen)}


def test_tis_weights_and_metrics_reach_the_batch_and_the_log():
    cfg = override(tiny_ppo(), use_tis=True, tis_clip=1.5, get_mismatch_metrics=True)
    b = batch()
    tis = load_user_functions(cfg).tis_function
    metrics = mismatch_correction(cfg, b, tis)
    want = (b["old_log_probs"] - b["rollout_log_probs"]).exp().clamp(0, 1.5) * b["loss_mask"]
    torch.testing.assert_close(b["tis_weights"], want)
    assert {"train/tis", "train/tis_clipfrac", "train/tis_weight", "train/tis_abs",
            "train/mis_kl", "train/mis_k3_kl", "train/mis_chi2_seq", "train/mis_training_ppl"} <= set(metrics)
    assert 0 < metrics["train/tis_clipfrac"] < 1
    sent = actor_batch(cfg, b)
    assert torch.equal(sent["tis_weights"], b["tis_weights"]) and torch.equal(sent["old_log_probs"], b["old_log_probs"])


def test_metrics_alone_leave_the_loss_unweighted_and_rollout_logprobs_replace_the_old_ones():
    cfg = override(tiny_ppo(), get_mismatch_metrics=True, use_rollout_logprobs=True)
    b = batch()
    metrics = mismatch_correction(cfg, b, load_user_functions(cfg).tis_function)
    assert "tis_weights" not in b and not any(k.startswith("train/tis") for k in metrics)
    assert torch.equal(actor_batch(cfg, b)["old_log_probs"], b["rollout_log_probs"])


def test_custom_tis_function_by_path_and_its_contract(tmp_path):
    cfg = override(tiny_ppo(), use_tis=True, custom_tis_function_path="algorithms.mismatch:masked_is")
    b = batch()
    fn = load_user_functions(cfg).tis_function
    assert fn is masked_is
    mismatch_correction(cfg, b, fn)
    assert (b["tis_weights"] == 0).any()
    bad = tmp_path / "bad_tis.py"
    bad.write_text("def tis(**kw):\n    return kw['mask'][:, :2], {}\n")
    cfg = override(cfg, custom_tis_function_path=f"{bad}:tis")
    with pytest.raises(ValueError, match=r"bad_tis.py:tis returned weights of shape .*expected \(4, 5\)"):
        mismatch_correction(cfg, batch(), load_user_functions(cfg).tis_function)
    with pytest.raises(ValueError, match=r"custom_tis_function_path=.*has no attribute 'nope'"):
        load_user_functions(override(cfg, custom_tis_function_path=f"{bad}:nope"))


def test_a_bad_user_function_stops_the_job_before_anything_is_written(tmp_path):
    """start_job loads the user's functions once, first: a bad path leaves no run dir behind."""
    from ppo.setup.job import start_job

    cfg = override(tiny_ppo(), run_dir=str(tmp_path / "run"), custom_tis_function_path="ppo.nothere:f")
    with pytest.raises(ValueError, match=r"custom_tis_function_path='ppo.nothere:f': cannot import"):
        start_job(cfg)
    assert not (tmp_path / "run").exists()
