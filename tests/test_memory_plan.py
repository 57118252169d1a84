"""The memory plan (ppo.gpu.memory_plan): sizes from the model spec, the one-line refusal with
the flags that make a plan fit, the dry run, and a run refused before any role starts. The
plan against the fake GPUs' ledgers, phase by phase: tests/test_e2e_ppo.py."""

from __future__ import annotations

import pytest

import launch
from ppo.config import override
from ppo.config.validate import ensure_valid
from ppo.gpu.memory_plan import GIB, RUNTIME_BYTES, model_parameters, plan_memory
from ppo.gpu.plan_report import refusal
from ppo.gpu.sizing import plan_spec
from ppo.config.recipes import qwen3_4b_ppo_1gpu, qwen3_4b_ppo_1gpu_80gb, tiny_ppo

H100 = 81079 << 20  # the lent H100 80GB HBM3: nvidia-smi's memory.total less memory.reserved
H200 = 143771 << 20
PROMPT = 512


def plan(cfg, capacity):
    return plan_memory(cfg, plan_spec(cfg), capacity=capacity, prompt_len=PROMPT)


def test_qwen3_4b_sizes_from_the_spec():
    spec = plan_spec(qwen3_4b_ppo_1gpu())  # /root/models/Qwen3-4B: the published config (ppo.make_model)
    policy = model_parameters(spec, lm_head=True)
    assert policy == 4_022_468_096  # what `make_checkpoint --arch qwen3-4b` counts (docs/benchmarks.md), tied
    assert model_parameters(spec, lm_head=False, value_head=True) == policy + 2560 + 1
    actor_train = {p.phase: p for p in plan(qwen3_4b_ppo_1gpu(), H200).phases}["actor_train"].held["actor"]
    # megatron: bf16 weights, float32 grads (grad_reduce_in_fp32), float32 main params + Adam moments
    assert (actor_train["weights"], actor_train["grads"], actor_train["optimizer"]) == (
        2 * policy, 4 * policy, 12 * policy)
    assert actor_train["cuda_context"] == RUNTIME_BYTES["trainer"]
    assert actor_train["slack"] == int(sum(v for k, v in actor_train.items() if k not in ("slack", "cuda_context")) * 0.02)


def test_the_h200_plan_fits_141_gb_and_builds_both_trainers_at_once():
    p = plan(qwen3_4b_ppo_1gpu(), H200)
    assert p.fits() and not p.builds_in_turn
    assert [x.phase for x in p.phases] == ["build", "rollout", "log_probs", "values", "critic_train",
                                           "actor_train", "weight_sync"]
    assert 110 * GIB < p.worst().peak < 120 * GIB and p.worst().phase == "actor_train"


def test_on_80_gb_the_h200_plan_is_refused_naming_phase_peak_memory_and_the_flags_that_fit():
    cfg = qwen3_4b_ppo_1gpu()
    p = plan(cfg, H100)
    line = refusal(cfg, p, lambda c: plan(c, H100))
    # the 80 GB recipe's plan (qwen3_4b_ppo_1gpu_80gb): everything moves, micro-batches of 8k tokens
    assert line == ("the memory plan does not fit: phase actor_train needs 104.5 GiB on GPU 0, which has 79.2 GiB; "
                    "it fits with --offload-rollout --offload-train-level all --max-tokens-per-gpu 8192 "
                    "(see it with --dry-run)")
    fixed = override(cfg, offload_rollout=True, offload_train_level="all", max_tokens_per_gpu=8192)
    assert plan(fixed, H100).fits()


def test_the_80_gb_recipe_fits_an_h100_its_trainers_building_in_turn():
    p = plan(ensure_valid(qwen3_4b_ppo_1gpu_80gb()), H100)
    assert p.fits() and p.builds_in_turn
    phases = {x.phase: x for x in p.phases}
    # the actor builds alone; the critic builds beside the actor's context only (it offloaded all)
    assert set(phases["build_actor"].held) == {"actor"}
    assert phases["build_critic"].held["actor"] == {"cuda_context": RUNTIME_BYTES["trainer"]}
    # while the actor trains, nothing else holds more than its CUDA context
    train = phases["actor_train"].held
    assert train["critic"] == {"cuda_context": RUNTIME_BYTES["trainer"]}
    assert train["rollout-0"] == {"cuda_context": RUNTIME_BYTES["engine"]}
    assert 70 * GIB < p.worst().peak < H100 - 1.5 * GIB
    # the engine's KV cache holds the rollout's 64 prompts and responses of 2048 tokens (147,456 bytes a token)
    assert phases["rollout"].held["rollout-0"]["kv_cache"] > 64 * (PROMPT + 2048) * 147_456


def test_48_gb_fits_with_three_quarters_of_the_optimizer_on_the_cpu_and_24_gb_not_at_all():
    cfg = qwen3_4b_ppo_1gpu_80gb()
    line = refusal(cfg, plan(cfg, 48 * GIB), lambda c: plan(c, 48 * GIB))
    assert line.endswith("it fits with --max-tokens-per-gpu 4096 --optimizer-cpu-offload --optimizer-offload-fraction 0.75 "
                         "(see it with --dry-run)")
    offloaded = plan(override(cfg, max_tokens_per_gpu=4096, optimizer_cpu_offload=True, optimizer_offload_fraction=0.75),
                     48 * GIB)
    assert offloaded.fits()
    assert {p.phase: p for p in offloaded.phases}["actor_train"].held["actor"]["optimizer"] == 3 * 4_022_468_096
    # megatron-core's CPU optimizer is planned, not built: a run with it stops at start-up
    from ppo.setup.job import optimizer_offload_problem

    assert "does not build megatron-core's CPU optimizer yet" in optimizer_offload_problem(
        override(cfg, optimizer_cpu_offload=True))
    line = refusal(cfg, plan(cfg, 24 * GIB), lambda c: plan(c, 24 * GIB))
    assert line.startswith("the memory plan does not fit: phase actor_train needs ")
    assert line.endswith("moving every state it can move is not enough: use more GPUs or a smaller model")


def test_the_dry_run_prints_the_plan_and_refuses_one_that_does_not_fit_with_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        launch.main(["--recipe", "qwen3_4b_ppo_1gpu", "--dry-run", "--gpu-memory-gb", "79.65"])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert "memory plan, GiB per GPU of 79.6 GiB (--gpu-memory-gb)" in out and "OVER" in out
    refusals = [line for line in err.splitlines() if "memory plan" in line]  # beside the --ref-load note
    assert len(refusals) == 1 and refusals[0].startswith(
        "tandem: the memory plan does not fit: phase actor_train needs 104.6 GiB on GPU 0")
    launch.main(["--recipe", "qwen3_4b_ppo_1gpu", "--dry-run", "--gpu-memory-gb", "140"])
    out, _ = capsys.readouterr()
    assert "GiB in phase actor_train on GPU 0: fits" in out


def test_a_run_whose_plan_does_not_fit_stops_before_any_role_starts(ckpt, tmp_path, capsys):
    """On the fake GPUs (80 GiB each) a weight-sync bucket buffer of 90 GiB does not fit."""
    run_dir, prompts = tmp_path / "run", tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+2=", "label": "3"}\n')
    with pytest.raises(SystemExit) as stop:
        launch.main(["--run-dir", str(run_dir), "--hf-checkpoint", ckpt, "--prompt-data", str(prompts),
                     "--update-weight-buffer-size", str(90 << 30), "--num-rollout", "2"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem: the memory plan does not fit: phase weight_sync needs 90.0 GiB on GPU 0, "
                          "which has 80.0 GiB; moving every state it can move is not enough")
    assert not (run_dir / "events.jsonl").exists()  # no supervisor, no role


def test_tiny_ppo_plans_its_fake_gpus_exactly():
    """What tiny_ppo's roles declare on a fake GPU, from its spec (tests/test_e2e_ppo.py holds the
    ledger to the same figures): float32 weights and AdamW moments, no CUDA context."""
    cfg = ensure_valid(override(tiny_ppo(), rollout_batch_size=16))  # 128 samples: the engine's KV rows
    p = plan_memory(cfg, plan_spec(cfg), capacity=80 * GIB, prompt_len=6)
    rollout = {x.gpu: x for x in p.phases if x.phase == "rollout"}
    assert rollout[0].held == {"actor": {}, "critic": {}, "rollout-0": {"weights": 320_512, "kv_cache": 4_194_304}}
    sync = {x.gpu: x.held["actor"] for x in p.phases if x.phase == "weight_sync"}
    assert sync[0]["sync_buffers"] == 512 << 20 and "sync_buffers" not in sync[1]  # rank 0 sends


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainers_the_plan_builds_in_turn_take_the_leases_one_after_the_other(tmp_path, monkeypatch):
    """Start-up follows the plan: each trainer holds its GPUs' leases while it builds and gives
    them up empty before the next one is spawned; the engines come after. (The torch backend
    builds on the CPU: the plan is made to say "in turn", as a megatron plan on 80 GB does.)"""
    import ppo.setup.job
    from ppo.gpu.memory_plan import MemoryPlan, PhaseMemory
    from ppo.setup.job import start_job
    from runtime.fakegpu import FakeDevice

    in_turn = MemoryPlan(capacity=80 * GIB, phases=tuple(
        PhaseMemory(phase=f"build_{role}", gpu=g, held={role: {}}) for role in ("actor", "critic") for g in (0, 1)))
    monkeypatch.setattr(ppo.setup.job, "check_memory_plan", lambda cfg, prompt_len: in_turn)
    job = start_job(override(tiny_ppo(), run_dir=str(tmp_path / "run"), num_rollout=1, rollout_batch_size=16))
    try:
        for gpu in (0, 1):
            leases = [(h["holder"], h["lease_holder"]) for h in FakeDevice(tmp_path / "run" / "fakegpu", gpu).history()
                      if h["kind"] == "lease"]
            # (new holder, holder after the change) of each lease change: None when released
            assert leases[:5] == [("actor", "actor"), (None, None), ("critic", "critic"), (None, None),
                                  (f"rollout-{gpu}", f"rollout-{gpu}")]
        assert job.colocation.holding == {"rollout-0", "rollout-1"}  # the engines hold theirs, the trainers none
    finally:
        job.close()


def _write_run(tmp_path, events: list[dict], phases: list[dict]) -> None:
    import json

    (tmp_path / "memory_plan.json").write_text(json.dumps({"capacity": 80 * GIB, "phases": phases}))
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({"seq": i + 1, **e}) + "\n" for i, e in enumerate(events)))


def test_the_plan_is_held_against_the_cuda_allocators_of_the_roles_in_each_phase(tmp_path):
    """runtime.child's cuda_memory events, per call, against the plan: a role called in the phase
    counts its peak, an idle one what it held after its last call; CUDA contexts left out."""
    from ppo.gpu.plan_check import cuda_mismatches, cuda_peaks

    ctx = {"cuda_context": 512 << 20}
    phases = [{"phase": "rollout", "gpu": 0, "peak": 0, "held": {"rollout-0": {"weights": 8 * GIB, "kv_cache": 40 * GIB, **ctx},
                                                                   "actor": {"weights": 8 * GIB, **ctx}}},
              {"phase": "actor_train", "gpu": 0, "peak": 0, "held": {"rollout-0": ctx,
                                                                       "actor": {"weights": 8 * GIB, "optimizer": 48 * GIB, **ctx}}}]

    def phase(name, action, ts):
        return {"event": "phase", "track": "driver", "step": 1, "phase": name, "action": action, "ts": ts}

    def call(role, began, ended, peak, held):
        return {"event": "cuda_memory", "role": role, "gpus": [0], "method": "m", "began": began, "ended": ended,
                "peak": peak, "held": held, "ts": ended}

    events = [call("actor.0", 0, 1, 60 * GIB, 8 * GIB), phase("rollout", "begin", 10),
              call("rollout-0", 10, 19, 49 * GIB, 47 * GIB), phase("rollout", "end", 20),
              call("rollout-0", 20, 21, 47 * GIB, 0), phase("actor_train", "begin", 30),
              call("actor.0", 30, 39, 50 * GIB, 8 * GIB), phase("actor_train", "end", 40)]
    _write_run(tmp_path, events, phases)
    rows = {(r["phase"], r["role"]): r for r in cuda_peaks(tmp_path, 1)}
    assert rows["rollout", "rollout-0"]["measured"] == 49 * GIB and rows["rollout", "rollout-0"]["called"]
    assert rows["rollout", "actor"]["measured"] == 8 * GIB and not rows["rollout", "actor"]["called"]
    assert rows["actor_train", "rollout-0"] == {"phase": "actor_train", "gpu": 0, "role": "rollout-0", "called": False,
                                                "planned": 0, "measured": 0}
    assert rows["actor_train", "actor"]["planned"] == 56 * GIB
    # rollout: 57 GiB against 56 (within 10%); actor_train: 50 against 56 (11% under)
    [miss] = cuda_mismatches(tmp_path, 1)
    assert miss.startswith("phase actor_train on GPU 0:") and "0.89x" in miss
    assert cuda_mismatches(tmp_path, 1, tolerance=0.2) == []
    assert cuda_mismatches(tmp_path, 2) == ["no planned phase of step 2 ran"]
