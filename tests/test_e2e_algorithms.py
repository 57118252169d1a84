"""Issue 24 end to end: GSPO with TIS, mismatch metrics and dynamic sampling on tiny_ppo, and a
resumed run that repeats the uninterrupted one (dynamic sampling's extra rounds included)."""

import shutil

import pytest

from ppo.state import checkpoint as ck
from ppo.config import ensure_valid, override
from ppo.config.recipes import tiny_ppo


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_gspo_tis_and_dynamic_sampling_run_and_resume_reproducibly(tmp_path):
    from ppo.loop import train

    cfg = ensure_valid(override(
        tiny_ppo(), advantage_estimator="gspo", eps_clip=3e-3, eps_clip_high=4e-3,
        use_tis=True, get_mismatch_metrics=True, tis_clip=1.5,
        dynamic_sampling_filter_path="ppo.generate.dynamic_sampling.check_reward_nonzero_std",
        rollout_batch_size=8, over_sampling_batch_size=12, global_batch_size=64, micro_batch_size=32,
        num_rollout=4, save=str(tmp_path / "a"), save_interval=2, run_dir=str(tmp_path / "run")))
    straight = train(cfg)
    for h in straight:
        kept, filled = h["rollout/dynamic_sampling_kept_groups"], h["rollout/dynamic_sampling_filled_groups"]
        assert min(kept, 8) + filled == 8
        assert kept + h["rollout/dynamic_sampling_dropped_groups"] == 12 * (1 + h["rollout/dynamic_sampling_extra_rounds"])
        # the engines run the actor's weights: weights ~1, nothing clipped, no mismatch
        assert h["train/tis_weight"] == pytest.approx(1.0, abs=1e-3) and h["train/tis_clipfrac"] == 0.0
        assert abs(h["train/mis_kl"]) < 1e-4 and h["train/mis_k3_kl"] < 1e-6
        assert h["train/ois"] == pytest.approx(1.0, abs=0.05) and "train/pg_loss" in h

    shutil.copytree(tmp_path / "a" / "rollout_00001", tmp_path / "b" / "rollout_00001")
    ck.write_tracker(str(tmp_path / "b"), "rollout_00001")
    resumed = train(override(cfg, load=str(tmp_path / "b"), save=str(tmp_path / "b")))
    assert [h["step"] for h in resumed] == [2, 3]
    for want, got in zip(straight[2:], resumed):
        differ = {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
                  if not k.startswith("perf/") and want.get(k) != got.get(k)}
        assert differ == {}, f"step {want['step']}: {differ}"
