"""bench.iteration's analysis of a run's events, on a short fake-GPU run (the GPU parts, the
pinned-copy peer and the memory sampler, run on the device only)."""

import pytest

from bench.iteration import COMPUTE_PHASES, analyse, prompt_tokens, report, steady_ratio
from ppo.config.serialize import override
from ppo.config.validate import ensure_valid
from ppo.loop import train
from ppo.config.recipes import tiny_ppo
from runtime.events import read_events

RATES = {"d2h": 50.0, "h2d": 50.0}


@pytest.mark.timeout(300)
def test_iteration_table_covers_each_step_and_finds_the_moves(tmp_path):
    run_dir = tmp_path / "run"
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(run_dir), num_rollout=2, num_critic_only_steps=0,
                                rollout_batch_size=16, eval_interval=1))  # step 0 evaluates twice, step 1 once
    history = train(cfg)
    ts = [e["ts"] for e in read_events(run_dir)]
    samples = [(t, i << 20, 2 << 30) for i, t in enumerate(ts)]  # GPU memory rising: the peak is the last sample
    prompts = prompt_tokens(run_dir, str(run_dir / "model" / "tiny-qwen3"))
    steps = analyse(run_dir, samples, RATES, num_samples=128, prompts=prompts)
    assert [s["step"] for s in steps] == [0, 1]
    for s, h in zip(steps, history):
        # phases and the handoffs between them tile the step
        assert sum(r["seconds"] for r in s["phases"]) == pytest.approx(s["step_s"], abs=2e-3)
        compute = sum(r["seconds"] for r in s["phases"] if r["phase"] in COMPUTE_PHASES)
        assert s["outside_s"] == pytest.approx(s["step_s"] - compute)
        assert any(r["phase"].startswith("handoff before") for r in s["phases"])
        assert s["response_tokens"] == pytest.approx(h["rollout/response_len"] * 128)
        assert s["prompt_tokens"] > 0 and s["actor_train_tokens_per_s"] > 0 and s["critic_train_tokens_per_s"] > 0
        assert sorted(k for k in s if k.endswith("_tokens_per_s")) == [
            "actor_train_tokens_per_s", "critic_train_tokens_per_s", "eval_tokens_per_s", "rollout_tokens_per_s"]
        assert [r["phase"] for r in s["phases"] if r["phase"] == "eval"] == ["eval"] * (2 if s["step"] == 0 else 1)
        assert s["eval_response_tokens"] >= 80 * (2 if s["step"] == 0 else 1)  # 5 sums x 16 samples, EOS at least
        moved = {(m["move"], tuple(m["tags"])) for m in s["moves"]}
        assert ("onload", ("params",)) in moved and any(m == "release" for m, _ in moved)
        assert all(m["vs_pinned"] == pytest.approx(m["gb_per_s"] / 50.0) for m in s["moves"])
        assert s["training_role_s"]["actor.0"] > 0
        peaks = [r["gpu_peak_gib"] for r in s["phases"]]
        assert peaks == sorted(peaks)  # each phase's peak is its latest sample, as the memory only rises
    text = report(steps, RATES)
    assert "outside compute" in text and "actor_train:" in text and "x pinned" in text and "x rollout)" in text


@pytest.mark.slow  # 20-56 s end to end; `make test` stays within its 20 minutes
@pytest.mark.timeout(300)
def test_main_runs_the_launch_flags_and_writes_the_report(tmp_path, monkeypatch, capsys):
    """The command line: flags after `--` are launch.py's; the GPU-only peer and sampler are
    replaced by constants here."""
    import json

    import bench.iteration as it

    monkeypatch.setattr(it, "pinned_copy_rates", lambda: RATES)
    monkeypatch.setattr(it.torch.cuda, "mem_get_info", lambda: (1 << 30, 3 << 30))
    code = it.main(["--out", str(tmp_path / "out"), "--", "--num-rollout", "2", "--rollout-batch-size", "16", "--global-batch-size", "64", "--micro-batch-size", "32",
                    "--num-critic-only-steps", "1", "--run-dir", str(tmp_path / "run"), "--quiet"])
    assert code == 0
    saved = json.loads((tmp_path / "out" / "iteration.json").read_text())
    assert [s["step"] for s in saved["steps"]] == [0, 1] and saved["error"] is None
    assert all(g == 2 << 30 for _, g, _ in saved["memory_samples"])
    assert "step 1:" in capsys.readouterr().out


def test_a_move_rate_counts_the_bytes_copied_not_the_grads_only_freed():
    """A megatron offload frees 64 GB (grads included) and copies 48 GB (optimizer): the rate
    is the copy's."""
    from bench.iteration import _move

    e = {"role": "actor.0", "phase": "offload", "tags": ["grads", "optimizer"], "bytes": 64e9,
         "copied": 48e9, "seconds": 1.0, "untracked": [3 << 20]}
    step = {"step": 0, "step_s": 1.0, "compute_s": 1.0, "outside_s": 0.0, "outside_share": 0.0, "phases": [],
            "rollout_tokens_per_s": 0, "response_tokens": 0, "training_role_s": {}, "generating_role_s": {}}

    def line(move: dict) -> str:
        return report([{**step, "moves": [move]}], RATES).splitlines()[-1]

    m = _move(e, RATES)
    assert (m["gb_per_s"], m["vs_pinned"], m["bytes"]) == (48.0, 48.0 / 50.0, 64e9)
    assert "48.00 GB copied" in line(m) and "0.96x pinned" in line(m) and "untracked 3.0 MiB" in line(m)
    freed = _move({**e, "phase": "release", "copied": 0, "untracked": []}, RATES)  # a KV cache dropped
    assert "nothing copied" in line(freed) and "pinned" not in line(freed)
    unknown = _move({**e, "phase": "release", "copied": None, "untracked": []}, RATES)  # an sglang engine
    assert unknown["gb_per_s"] is None and "? GB copied" in line(unknown) and "pinned" not in line(unknown)


def test_the_steady_ratio_compares_steps_1_to_n_minus_2_with_the_same_steps_of_the_synchronous_run():
    side = [{"step_s": s} for s in (50.0, 20.0, 22.0, 9.0)]  # the last: no rollout ahead beside it
    sync = [{"step_s": s} for s in (60.0, 30.0, 32.0, 30.0)]
    assert (steady_ratio(side, sync, name="grpo")
            == "steady iteration (steps 1..2): 21.00 s here, 31.00 s in grpo (steps 1..2): 0.68x")
    # a synchronous run cut after step 1 (its time limit) still compares: its step 1 is steady
    assert (steady_ratio(side[:3], sync[:2], name="grpo")
            == "steady iteration (steps 1..1): 20.00 s here, 30.00 s in grpo (steps 1..1): 0.67x")
    assert "needs 3 steps here and 2 in grpo (2 and 4 ran)" in steady_ratio(side[:2], sync, name="grpo")
    assert "(3 and 1 ran)" in steady_ratio(side[:3], sync[:1], name="grpo")
