"""Trainer recovery (--max-trainer-restarts, ppo.recovery): a trainer rank killed mid-run brings
the trainers back from the newest checkpoint and the run goes on, repeating an uninterrupted run."""

import json

import pytest

from bench.faults import Injector, after_first_rollout
from ppo.config.serialize import override
from ppo.config.validate import ConfigError, ensure_valid
from ppo.setup.job import start_job
from ppo.loop import TrainerDied, run
from ppo.config.recipes import tiny_ppo
from ppo.observe.trace import build_trace, read_trace
from runtime.events import read_events
from runtime.fakegpu import FakeDevice, check_no_overlap

pytestmark = pytest.mark.timeout(300)

# counts of the recovery itself: the one thing an interrupted run logs differently
RECOVERY_METRICS = ("train/trainer_restarts_total",)


def tiny(tmp_path, name, **values):
    values = {"num_rollout": 4, **values}
    return ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / name), rollout_batch_size=16,
                                 save=str(tmp_path / name / "ckpt"), save_interval=1, **values))


def run_job(cfg, victim=None, times=1):
    job = start_job(cfg)
    inj = None
    if victim is not None:
        inj = Injector(job, victim, after_first_rollout(victim, "training"), times=times)
        inj.start()
    try:
        return run(job), inj
    finally:
        if inj is not None:
            inj.stop = True
        job.close()


def metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/") and k not in RECOVERY_METRICS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_killed_actor_rank_is_recovered_from_the_checkpoint_and_the_run_repeats_an_uninterrupted_one(tmp_path):
    history, inj = run_job(tiny(tmp_path, "killed", max_trainer_restarts=1), victim="actor.1")
    assert inj.fired_at, "the fault was never injected"
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["train/trainer_restarts_total"] == 1
    events = read_events(tmp_path / "killed")
    rewind, = [e for e in events if e["event"] == "rewind"]
    assert rewind["role"] == "actor.1" and rewind["to_step"] == rewind["from_step"]  # saved every step: none redone
    assert history[-1]["train/rewound_steps_total"] == 0
    # every rank of both trainers came back, each a new incarnation
    restarted = {e["role"] for e in events if e["event"] == "restarted"}
    assert restarted == {"actor.0", "actor.1", "critic.0", "critic.1"}
    # the fake GPUs' ledgers stayed exact: no two holders ever overlapped
    for gpu in (0, 1):
        assert check_no_overlap(FakeDevice(tmp_path / "killed" / "fakegpu", gpu).history()) == []
    trace = read_trace(build_trace(tmp_path / "killed"))
    assert any(t.get("ph") == "i" and t["name"].startswith("rewind to step") for t in trace)

    run_job(tiny(tmp_path, "straight"))
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "straight")  # every step, bit for bit


@pytest.mark.slow  # a second end-to-end run after the first test's; `make test` keeps that one
def test_a_second_trainer_death_past_the_limit_stops_the_run(tmp_path):
    with pytest.raises(TrainerDied) as info:
        # GRPO: no critic ranks to start, and the actor trains (and dies) from rollout 0
        run_job(tiny(tmp_path, "twice", max_trainer_restarts=1, advantage_estimator="grpo"), victim="actor.1", times=2)
    msg = str(info.value)
    assert "the actor trainer died: its rank 1 (actor.1) died (killed by SIGKILL)" in msg
    assert "(after 1 of --max-trainer-restarts 1 recoveries)" in msg
    assert f"--load {tmp_path / 'twice' / 'ckpt'}" in msg


def test_max_trainer_restarts_needs_save_and_a_count():
    with pytest.raises(ConfigError, match=r"--max-trainer-restarts 1 is set but --save .* Please add --save PATH"):
        ensure_valid(override(tiny_ppo(), max_trainer_restarts=1))
    with pytest.raises(ConfigError, match=r"--max-trainer-restarts -1 \(checkpoint.max_trainer_restarts\): "
                                          r"must be >= 0"):
        ensure_valid(override(tiny_ppo(), max_trainer_restarts=-1, save="/tmp/x"))


@pytest.mark.gpu
def test_a_killed_megatron_actor_is_recovered_on_a_gpu(tmp_path):
    """The megatron backend, once on a GPU (`bash .ci/gpu -k recovered`): the same recovery, one
    rank on one real GPU. Bit-for-bit equality is not asked of CUDA kernels; the engines are
    checked to hold the actor's weights after the recovery's sync and every later one."""
    pytest.importorskip("megatron.core")
    cfg = tiny(tmp_path, "killed", max_trainer_restarts=1, train_backend="megatron", fake_gpus=False,
               actor_num_gpus_per_node=1, num_gpus_per_node=1, check_weight_update_equal=True)
    history, inj = run_job(cfg, victim="actor.0")
    assert inj.fired_at, "the fault was never injected"
    assert [h["step"] for h in history] == [0, 1, 2, 3]
    assert history[-1]["train/trainer_restarts_total"] == 1
    assert [e["role"] for e in read_events(tmp_path / "killed") if e["event"] == "rewind"] == ["actor.0"]


def test_a_refused_or_failed_recovery_says_why_in_the_stop_line():
    from types import SimpleNamespace

    from ppo.recovery import trainer_died
    from runtime import ActorDied

    cfg = ensure_valid(override(tiny_ppo(), max_trainer_restarts=2, save="/tmp/ck"))
    actor = SimpleNamespace(name="actor", rank_of=lambda role: 1)
    died = ActorDied("actor.1", 0, "killed by SIGKILL")
    failed = str(trainer_died(cfg, actor, died, 1, why="recovery 1 failed: the new rank died"))
    assert "the run stopped (recovery 1 failed: the new rank died)" in failed and "--load /tmp/ck" in failed
    assert "(before its first checkpoint: nothing to recover from)" in str(trainer_died(cfg, actor, died, 0))


@pytest.mark.gpu
def test_megatron_trainers_save_export_and_resume_in_the_loop_on_a_gpu(tmp_path):
    """`--save`, `--save-hf` and `--load` with megatron trainers on one GPU (`bash .ci/gpu -k
    in_the_loop`): the trainers save and load inside the driver's checkpoint windows
    (ppo.gpu.handoffs), the HF export loads in transformers, and the resumed run's engines hold
    the actor's weights after its sync (--check-weight-update-equal)."""
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    gpu = dict(train_backend="megatron", fake_gpus=False, actor_num_gpus_per_node=1, num_gpus_per_node=1,
               check_weight_update_equal=True)
    cfg = tiny(tmp_path, "first", num_rollout=2, save_hf=str(tmp_path / "hf_{rollout_id}"), **gpu)
    history, _ = run_job(cfg)
    assert [h["step"] for h in history] == [0, 1]
    assert AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_1")).config.num_hidden_layers > 0
    resumed = tiny(tmp_path, "resumed", num_rollout=3, load=str(tmp_path / "first" / "ckpt"), **gpu)
    history, _ = run_job(resumed)
    assert [h["step"] for h in history] == [2]
    assert history[-1]["rollout/weight_version"] == 2  # the critic warmed up alone at rollout 0
