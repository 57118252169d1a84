"""PPO run checkpoints (ppo/state/checkpoint.py): atomic saves, refusals that say what is wrong,
trainer RNG and HF exports, and a resumed run that repeats the uninterrupted one."""

import errno
import contextlib
import json
import re
import os
import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ppo.state import checkpoint as ck
from ppo.config import override, validate
from ppo.config.validate import ensure_valid
from ppo.prompts.dataset import PromptDataset
from ppo.state.manifest import write_manifest
from ppo.observe.metrics_file import trim_metrics
from ppo.config.recipes import tiny_ppo
from ppo.tiny_model import build_tiny_checkpoint
from runtime.events import read_events
from roles.trainer.rng import capture_rng, restore_rng
from roles.trainer.config import TrainerConfig
from roles.trainer.torch import ActorTrainer, CriticTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), seed=0)


def trainer_config(hf, **overrides):
    return TrainerConfig(hf_checkpoint=hf, dtype="float32", seed=7, lr=1e-3, min_lr=0.0, lr_decay_style="constant",
                lr_warmup_iters=0, weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4,
                micro_batch_size=2, eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean",
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0,
                keep_ref=False, **overrides)


def resident(trainer):
    """A trainer with its weights and optimizer on the device, as the driver's checkpoint
    windows leave it for a save or a load (ppo.gpu.handoffs)."""
    trainer.onload(["params", "optimizer"])
    return trainer


@pytest.fixture(scope="module")
def trainers(hf):
    return resident(ActorTrainer(trainer_config(hf))), resident(CriticTrainer(trainer_config(hf)))


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    return PromptDataset(path, seed=3)


def save(tmp_path, trainers, data, step, hf):
    actor, critic = trainers
    state = {"format": ck.FORMAT, "rollout_step": step, "weight_version": step, "data": data.state_dict(),
             "rng": capture_rng(), "model": ck.model_signature(hf), "config": {}}
    return ck.save_checkpoint(str(tmp_path / "save"), step, actor=actor, state=state, critic=critic,
                              critic_dir=str(tmp_path / "save_critic"))


def locate(tmp_path, hf, load="save", critic_load="save_critic"):
    return ck.locate(str(tmp_path / load), critic_load=str(tmp_path / critic_load), uses_critic=True,
                     hf_checkpoint=hf)


# ---- saving ---------------------------------------------------------------------------------


def test_checkpoint_layout_tracker_and_separate_critic_folder(tmp_path, trainers, data, hf):
    data.next_batch(3)
    save(tmp_path, trainers, data, 1, hf)
    save(tmp_path, trainers, data, 3, hf)
    assert (tmp_path / "save" / "latest").read_text() == "rollout_00003\n"
    assert (tmp_path / "save_critic" / "latest").read_text() == "rollout_00003\n"
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00001", "rollout_00003"]
    found = locate(tmp_path, hf)
    assert (found.step, found.actor_dir.name, found.critic_dir) == (3, "rollout_00003",
                                                                    tmp_path / "save_critic" / "rollout_00003")
    assert found.state["data"] == data.state_dict() and found.state["data"]["position"] == 3
    with safe_open(found.critic_dir / "model.safetensors", "pt") as f:
        assert any(k.startswith("value_head") for k in f.keys())  # the critic's weights, not the actor's


class CrashingActor:
    """Writes part of the checkpoint into the temp dir, then dies (disk full, SIGTERM, ...)."""

    def save(self, path):
        os.makedirs(path)
        (open(os.path.join(path, "model.safetensors"), "wb")).write(b"\0" * 100)
        raise OSError("No space left on device")


def test_crash_mid_save_leaves_latest_on_the_previous_checkpoint(tmp_path, trainers, data, hf):
    save(tmp_path, trainers, data, 1, hf)
    state = {"format": ck.FORMAT, "rollout_step": 3}
    with pytest.raises(OSError, match="No space"):
        ck.save_checkpoint(str(tmp_path / "save"), 3, actor=CrashingActor(), state=state, critic=trainers[1],
                           critic_dir=str(tmp_path / "save_critic"))
    # a failure after the actor's files are in the temp dir: the driver state cannot be written
    with pytest.raises(TypeError):
        ck.save_checkpoint(str(tmp_path / "save"), 3, actor=trainers[0], state={"bad": object()})
    assert (tmp_path / "save" / "latest").read_text() == "rollout_00001\n"
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00001"]  # temp dirs cleaned up
    # the critic finished its rollout_00003 before the crash; the resume still pairs 00001 with 00001
    found = locate(tmp_path, hf)
    assert found.actor_dir.name == "rollout_00001" and found.critic_dir.name == "rollout_00001"
    # a crash that kills the process leaves the temp dir behind: ignored, and replaced by the next save
    os.makedirs(tmp_path / "save" / ".rollout_00003.partial")
    assert locate(tmp_path, hf).step == 1
    save(tmp_path, trainers, data, 3, hf)
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00001", "rollout_00003"]


def record_disk_ops(monkeypatch) -> list[tuple]:
    """Every fsync (by the path of its descriptor) and rename, in the order they happen."""
    ops: list[tuple] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        ops.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        real_rename(src, dst)
        ops.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    def replace(src, dst):
        real_replace(src, dst)
        ops.append(("rename", os.path.abspath(src), os.path.abspath(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    return ops


def test_files_and_folders_reach_the_disk_before_the_tracker_moves(tmp_path, trainers, data, hf, monkeypatch):
    ops = record_disk_ops(monkeypatch)
    save(tmp_path, trainers, data, 2, hf)
    save_dir, final = str(tmp_path / "save"), str(tmp_path / "save" / "rollout_00002")

    def index(op):
        assert op in ops, f"{op} did not happen: {ops}"
        return ops.index(op)

    for folder in (final, str(tmp_path / "save_critic" / "rollout_00002")):
        parent = os.path.dirname(folder)
        moved = next(i for i, op in enumerate(ops) if op[0] == "rename" and op[2] == folder)
        tmp = ops[moved][1]
        files = sorted(os.listdir(folder))
        assert set(ck.TRAINER_FILES) <= set(files) and "MANIFEST.json" in files
        tracker = index(("rename", os.path.join(parent, ".latest.tmp"), os.path.join(parent, "latest")))
        if folder == final:
            for f in files:  # each file, then its folder, fsynced before the rename...
                assert index(("fsync", os.path.join(tmp, f))) < index(("fsync", tmp)) < moved
        else:  # the critic's role renames its folder; the driver adds the manifest, before the tracker moves
            for f in set(files) - {"MANIFEST.json"}:
                assert index(("fsync", os.path.join(tmp, f))) < index(("fsync", tmp)) < moved
            assert moved < index(("fsync", os.path.join(folder, "MANIFEST.json"))) < index(("fsync", folder)) < tracker
        # ...and the parent, which records the rename, after it
        assert any(op == ("fsync", parent) for op in ops[moved + 1:])
        assert moved < index(("fsync", os.path.join(parent, ".latest.tmp"))) < tracker
        assert ("fsync", parent) in ops[tracker + 1:]  # the tracker's rename is durable too
    assert "driver_state.json" in os.listdir(final)
    # the critic's checkpoint is complete before the actor's tracker names the step
    assert index(("rename", str(tmp_path / "save_critic" / ".latest.tmp"), str(tmp_path / "save_critic" / "latest"))) \
        < index(("rename", os.path.join(save_dir, ".latest.tmp"), os.path.join(save_dir, "latest")))


def test_keep_last_prunes_old_checkpoints_but_never_the_one_the_tracker_names(tmp_path, trainers, data, hf):
    actor, critic = trainers
    state = {"format": ck.FORMAT, "rollout_step": 0}
    for step in (0, 1, 2, 3):
        ck.save_checkpoint(str(tmp_path / "save"), step, actor=actor, state=dict(state, rollout_step=step),
                           critic=critic, critic_dir=str(tmp_path / "save_critic"), keep_last=2)
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00002", "rollout_00003"]
    assert sorted(os.listdir(tmp_path / "save_critic")) == ["latest", "rollout_00002", "rollout_00003"]
    # an operator pointed `latest` back at an older checkpoint: pruning keeps it
    ck.write_tracker(str(tmp_path / "save"), "rollout_00002")
    for step in (4, 5):
        os.makedirs(tmp_path / "save" / ck.rollout_dir_name(step))
    assert ck.prune(str(tmp_path / "save"), 1) == ["rollout_00003", "rollout_00004"]
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00002", "rollout_00005"]


def test_run_counters_travel_in_the_driver_state(tmp_path, trainers, data, hf):
    counters = ck.RunCounters(skipped_updates=2, engine_restarts=3, scorer_restarts=1, skipped_samples=4)
    state = ck.driver_state(override(tiny_ppo(), hf_checkpoint=hf), 1, data=data, version=1, hf_checkpoint=hf,
                            counters=counters)
    ck.save_checkpoint(str(tmp_path / "save"), 1, actor=trainers[0], state=state, critic=trainers[1],
                       critic_dir=str(tmp_path / "save_critic"))
    assert ck.RunCounters(**locate(tmp_path, hf).state["counters"]) == counters
    assert ck.ResumePoint(step=0, version=0).counters == ck.RunCounters()  # a fresh run counts from 0


def test_keep_last_is_validated():
    problems = validate(override(tiny_ppo(), save="s", save_keep_last=0))
    assert any("--save-keep-last 0" in p for p in problems)
    assert any("--save-keep-last is set but --save" in p for p in validate(override(tiny_ppo(), save_keep_last=2)))


def test_saves_every_interval_and_after_the_last_rollout():
    cfg = override(tiny_ppo(), num_rollout=5, save="s", save_interval=2)
    assert [s for s in range(5) if ck.is_due(cfg, s)] == [1, 3, 4]
    assert [s for s in range(5) if ck.is_due(override(cfg, save_interval=None), s)] == [4]
    assert not any(ck.is_due(override(cfg, save=None, save_interval=None), s) for s in range(5))
    assert [s for s in range(5) if ck.is_due(override(cfg, save=None, save_interval=None, save_hf="h"), s)] == [4]


def test_trim_metrics_drops_steps_after_the_checkpoint_and_a_torn_line(tmp_path):
    lines = [json.dumps({"step": s, "x": s}) for s in range(4)] + ['{"step": 4, "x"']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    trim_metrics(tmp_path, 1)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_trim_metrics_keeps_the_eval_of_the_checkpointed_weights(tmp_path):
    """The eval after rollout 1 is tagged 2 (the rollout that samples from those weights) and
    written before checkpoint 1: a resume from 1 does not evaluate again, so the line stays."""
    lines = [{"step": 0, "eval/sums": 0.1}, {"step": 0}, {"step": 1}, {"step": 2, "eval/sums": 0.2}, {"step": 2},
             {"step": 3, "eval/sums": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    trim_metrics(tmp_path, 1)
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == lines[:4]


# ---- refusals -------------------------------------------------------------------------------


def test_load_dir_without_any_checkpoint_starts_fresh(tmp_path, hf):
    assert locate(tmp_path, hf, load="does-not-exist") is None
    (tmp_path / "empty").mkdir()
    assert locate(tmp_path, hf, load="empty") is None


def test_load_dir_without_any_checkpoint_starts_at_step_0_and_deletes_nothing(tmp_path):
    """ppo.state.rundir lets such a run only into a run dir without an earlier run; resume removes nothing."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "r": 1}\n')
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(load="empty"))
    job = SimpleNamespace(cfg=cfg, resume_from=None, run_dir=tmp_path, hf_checkpoint="hf")
    assert ck.resume(job, data=None) == ck.ResumePoint(step=0, version=0)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0, "r": 1}\n'


@pytest.mark.parametrize("damage, message", [
    (lambda d: ((d / "save" / "latest").write_text("rollout_00009\n"), shutil.rmtree(d / "save" / "rollout_00001")),
     r"latest names rollout_00009, but .*rollout_00009 does not exist; nothing to resume from"),
    (lambda d: ((d / "save" / "latest").write_bytes(os.urandom(64)), shutil.rmtree(d / "save" / "rollout_00001")),
     r"save/latest should name a rollout_NNNNN folder but holds"),
    (lambda d: (d / "save" / "rollout_00001" / "optimizer.pt").write_bytes(b"x"),
     r"save/rollout_00001/optimizer.pt has 1 bytes, \d+ were written \(truncated\?\); nothing to resume from"),
    (lambda d: (d / "save_critic" / "rollout_00001" / "model.safetensors").open("r+b").write(b"\0" * 8),
     r"save_critic/rollout_00001/model.safetensors does not match its checksum"),
    (lambda d: (d / "save" / "latest").unlink(), r"holds \['rollout_00001'\] but no 'latest' file.*echo rollout_00001"),
    (lambda d: (d / "save" / "rollout_00001" / "optimizer.pt").unlink(), r"incomplete, missing \['optimizer.pt'\]"),
    (lambda d: (d / "save" / "rollout_00001" / "driver_state.json").write_text('{"format": 1, "roll'),
     r"driver_state.json is not valid JSON \(truncated\?\)"),
    (lambda d: shutil.rmtree(d / "save_critic" / "rollout_00001"),
     r"critic's .*save_critic/rollout_00001 does not exist.*--critic-load"),
    (lambda d: (d / "save_critic" / "rollout_00001" / "trainer_state.json").unlink(),
     r"critic's .* is incomplete, missing \['trainer_state.json'\]"),
    (lambda d: os.rename(d / "save" / "rollout_00001", d / "save" / "rollout_00002")
     or (d / "save" / "latest").write_text("rollout_00002"), r"rollout_00002 holds the driver state of rollout 1"),
])
def test_damaged_checkpoint_is_refused_saying_what_is_wrong(tmp_path, trainers, data, hf, damage, message):
    save(tmp_path, trainers, data, 1, hf)
    damage(tmp_path)
    with pytest.raises(ck.CheckpointError, match=message):
        locate(tmp_path, hf)


def test_checkpoint_of_another_model_or_a_critic_folder_is_refused(tmp_path, trainers, data, hf):
    save(tmp_path, trainers, data, 1, hf)
    other = build_tiny_checkpoint(str(tmp_path / "other"), seed=0, hidden_size=32, num_layers=3)
    with pytest.raises(ck.CheckpointError, match=r"another model.*hidden_size: checkpoint 64, --hf-checkpoint 32; "
                                                 r"num_hidden_layers: checkpoint 2, --hf-checkpoint 3"):
        locate(tmp_path, other)
    with pytest.raises(ck.CheckpointError, match=r"missing \['driver_state.json'\] \(this looks like a critic folder"):
        locate(tmp_path, hf, load="save_critic")
    # the trainer's own check, for a checkpoint whose driver state was not consulted
    small = resident(ActorTrainer(trainer_config(other)))
    with pytest.raises(ValueError, match=r"does not match the model"):
        small.load(str(tmp_path / "save" / "rollout_00001"))


def test_resume_refuses_a_finished_run(tmp_path, trainers, data, hf):
    save(tmp_path, trainers, data, 3, hf)
    cfg = override(tiny_ppo(), num_rollout=4, load=str(tmp_path / "save"),
                   critic_load=str(tmp_path / "save_critic"))
    job = SimpleNamespace(cfg=cfg, critic=object(), hf_checkpoint=hf, resume_from=locate(tmp_path, hf))
    with pytest.raises(ck.CheckpointError, match=r"after rollout 3, and --num-rollout 4 leaves nothing to run"):
        ck.resume(job, data)


def test_critic_folders_must_differ_from_the_actors():
    problems = validate(override(tiny_ppo(), save="ck/run", critic_save="ck/run/"))
    assert any("--critic-save" in p and "folder of their own" in p for p in problems)
    problems = validate(override(tiny_ppo(), load="ck/run", critic_load="ck/./run"))
    assert any("--critic-load" in p for p in problems)
    assert validate(override(tiny_ppo(), load="ck/run", save="ck/run")) == []  # defaults: ck/run_critic


# ---- trainer state ----------------------------------------------------------------------------


def test_rng_state_round_trips_for_python_numpy_and_torch():
    state = json.loads(json.dumps(capture_rng()))  # as stored: JSON
    want = (random.random(), np.random.rand(), torch.rand(2).tolist())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == want


def test_trainer_load_restores_its_rng_state(tmp_path, trainers, hf):
    actor = trainers[0]
    actor.save(str(tmp_path / "a"))
    after_save = torch.rand(3)
    torch.manual_seed(99)
    resident(ActorTrainer(trainer_config(hf))).load(str(tmp_path / "a"))
    assert torch.equal(torch.rand(3), after_save)


def test_save_hf_writes_a_checkpoint_transformers_loads(tmp_path, trainers, hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = trainers[0]
    with torch.no_grad():
        next(actor.model.parameters()).add_(1.0)  # not the weights it started from
    try:
        actor.save_hf(str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        got = dict(model.named_parameters())
        for name, w in actor.named_weights():
            assert torch.equal(got[name], w), name
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_cache"] is True  # the source's
        assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("1+2=") == \
            AutoTokenizer.from_pretrained(hf).encode("1+2=")
    finally:
        with torch.no_grad():
            next(actor.model.parameters()).sub_(1.0)


# ---- a resumed run repeats the uninterrupted one ---------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumed_run_repeats_the_uninterrupted_one(tmp_path):
    """4 rollouts straight vs rollouts 0-1, a checkpoint, and rollouts 2-3 in a new job.

    The interrupted run is the straight run's own checkpoint after rollout 1 (with a
    constant LR the first half of a 2-rollout run is the same computation). Every metric but
    timings must match bit for bit: sampling is seeded per request from (seed, step, index),
    the trainers restore fp32 weights, AdamW state and step exactly, the engines get those
    fp32 weights by a weight sync, and each role runs one thread in the same order.
    """
    from ppo.loop import train

    cfg = ensure_valid(override(tiny_ppo(), rollout_batch_size=16, num_rollout=4, save=str(tmp_path / "a"),
                                save_interval=2, run_dir=str(tmp_path / "run")))
    straight = train(cfg)
    # the save window's handoffs are the checkpoint's time, not the next step's offload_time
    saves = [e for e in read_events(tmp_path / "run") if e["event"] == "checkpoint"]
    assert [e["step"] for e in saves] == [1, 3] and all(e["seconds"] >= e["handoff_seconds"] > 0 for e in saves)
    for folder in ("a", "a_critic"):  # "the run stopped after rollout 1": its checkpoint, in a new folder
        shutil.copytree(tmp_path / folder / "rollout_00001", tmp_path / folder.replace("a", "b") / "rollout_00001")
        ck.write_tracker(str(tmp_path / folder.replace("a", "b")), "rollout_00001")
    # the interrupted run had counted restarts and a skipped update: the resumed run goes on from there
    state_file = tmp_path / "b" / "rollout_00001" / ck.DRIVER_STATE_FILE
    state = json.loads(state_file.read_text())
    assert state["counters"] == {"skipped_updates": 0, "engine_restarts": 0, "scorer_restarts": 0,
                                 "skipped_samples": 0, "trainer_restarts": 0, "rewound_steps": 0}
    state["counters"].update(skipped_updates=1, engine_restarts=3, scorer_restarts=2, trainer_restarts=1)
    state_file.write_text(json.dumps(state))
    write_manifest(state_file.parent)  # the edited file's new size and checksum
    resumed = train(override(cfg, load=str(tmp_path / "b"), save=str(tmp_path / "b"),
                             save_hf=str(tmp_path / "hf_{rollout_id}"), save_keep_last=1,
                             check_weight_update_equal=True))  # the engines run the checkpoint's policy

    assert [h["step"] for h in resumed] == [2, 3]
    assert [h["rollout/weight_version"] for h in resumed] == [2, 3]
    for want, got in zip(straight[2:], resumed):
        # the resumed run evaluates the weights it starts from (tiny_ppo's eval, as miles does)
        assert set(want) | {"perf/eval_time"} == set(got) | {"perf/eval_time"}
        differ = {k: (want[k], got[k]) for k in want
                  if not k.startswith("perf/") and not k.endswith("_total") and want[k] != got[k]}
        assert differ == {}, f"step {want['step']}: {differ}"
        assert (got["train/skipped_updates_total"], got["rollout/engine_restarts_total"],
                got["rollout/scorer_restarts_total"], got["train/trainer_restarts_total"]) == (1, 3, 2, 1)
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [h for h in logged if "eval/weight_version" not in h]  # tiny_ppo's eval lines (ppo.generate.evaluation)
    assert [h["step"] for h in logged] == [0, 1, 2, 3]  # the resume replaced the straight run's 2 and 3
    assert (tmp_path / "b" / "latest").read_text() == "rollout_00003\n"
    assert sorted(os.listdir(tmp_path / "b")) == ["latest", "rollout_00003"]  # --save-keep-last 1
    assert sorted(os.listdir(tmp_path / "b_critic")) == ["latest", "rollout_00003"]
    saved = json.loads((tmp_path / "b" / "rollout_00003" / ck.DRIVER_STATE_FILE).read_text())["counters"]
    assert (saved["skipped_updates"], saved["engine_restarts"], saved["scorer_restarts"],
            saved["trainer_restarts"]) == (1, 3, 2, 1)
    assert (tmp_path / "b_critic" / "rollout_00003" / "model.safetensors").exists()
    # --save-hf: the policy of the last rollout (fp32 on fake GPUs), readable by transformers
    from transformers import AutoModelForCausalLM
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_3", dtype=torch.float32)
    saved = load_file(tmp_path / "b" / "rollout_00003" / "model.safetensors")
    assert all(torch.equal(p, saved[name]) for name, p in exported.named_parameters())


@pytest.mark.parametrize("damage, message, used", [
    (lambda d: (d / "save" / "rollout_00003" / "optimizer.pt").open("r+b").truncate(100),
     r"save/rollout_00003/optimizer.pt has 100 bytes, \d+ were written \(truncated\?\)", 1),
    (lambda d: (d / "save" / "rollout_00003" / "model.safetensors").open("r+b").truncate(10),
     r"save/rollout_00003/model.safetensors has 10 bytes", 1),
    (lambda d: (d / "save_critic" / "rollout_00003" / "optimizer.pt").unlink(),
     r"the critic's .*save_critic/rollout_00003 is incomplete, missing \['optimizer.pt'\]", 1),
    (lambda d: (d / "save" / "latest").write_bytes(os.urandom(64)),  # then the newest intact of all
     r"save/latest should name a rollout_NNNNN folder but holds", 3),
    (lambda d: (d / "save" / "latest").write_text("rollout_00005\n"),
     r"save/latest names rollout_00005, but .*rollout_00005 does not exist", 3),
])
def test_a_damaged_newest_checkpoint_falls_back_to_the_newest_intact_one_with_one_warning(
        tmp_path, trainers, data, hf, damage, message, used, caplog):
    save(tmp_path, trainers, data, 1, hf)
    save(tmp_path, trainers, data, 3, hf)
    damage(tmp_path)
    found = locate(tmp_path, hf)
    name = ck.rollout_dir_name(used)
    assert (found.step, found.critic_dir.name) == (used, name)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert re.search(message, warning), warning
    assert warning.endswith(f"resuming from {tmp_path / 'save' / name} instead, the newest intact checkpoint")


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path, trainers, data, hf):
    folder = save(tmp_path, trainers, data, 1, hf)
    listed = json.loads((folder / "MANIFEST.json").read_text())["files"]
    assert sorted(listed) == sorted([*ck.TRAINER_FILES, ck.DRIVER_STATE_FILE])
    assert all(v["size"] == (folder / k).stat().st_size for k, v in listed.items())
    assert sorted(json.loads((tmp_path / "save_critic" / "rollout_00001" / "MANIFEST.json").read_text())["files"]) \
        == sorted(ck.TRAINER_FILES)


def test_manifest_checks_large_files_piece_by_piece(tmp_path, monkeypatch):
    from ppo.state import manifest
    monkeypatch.setattr(manifest, "PIECE", 1000)
    (tmp_path / "big").write_bytes(os.urandom(2500))
    (tmp_path / "empty").write_bytes(b"")
    manifest.write_manifest(tmp_path)
    listed = json.loads((tmp_path / "MANIFEST.json").read_text())["files"]
    assert len(listed["big"]["crc32"]) == 3 and listed["empty"] == {"size": 0, "crc32": [0]}
    assert manifest.damage(tmp_path) is None
    with open(tmp_path / "big", "r+b") as f:  # one byte of the last piece
        f.seek(2400)
        f.write(bytes([f.read(1)[0] ^ 1]))
    assert manifest.damage(tmp_path) == f"{tmp_path / 'big'} does not match its checksum (overwritten or corrupted)"


# ---- a save that cannot be written ------------------------------------------------------------


class FullDiskActor:
    """A trainer whose save fails as on a full disk: the driver's OSError, or a role's RemoteError
    from torch that does not say why ("unexpected pos")."""

    def __init__(self, remote: bool):
        self.remote = remote

    def save(self, path):
        os.makedirs(path)
        (open(os.path.join(path, "model.safetensors"), "wb")).write(b"\0" * 100)
        if self.remote:
            from runtime import RemoteError
            raise RemoteError("actor.0", "save", "RuntimeError", "[enforce fail at inline_container.cc:783] . "
                              "PytorchStreamWriter failed writing file data/3: file write failed\nunexpected pos 1",
                              "Traceback ...")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(path, "optimizer.pt"))


@pytest.mark.parametrize("remote", [False, True])
def test_a_full_disk_stops_the_save_in_one_line_and_keeps_the_last_checkpoint(tmp_path, trainers, data, hf,
                                                                                monkeypatch, remote):
    save(tmp_path, trainers, data, 1, hf)
    cfg = override(tiny_ppo(), save=str(tmp_path / "save"), save_interval=1, num_rollout=4)
    job = SimpleNamespace(cfg=cfg, actor=FullDiskActor(remote), critic=None, hf_checkpoint=hf, actor_tenant=None,
                          sup=SimpleNamespace(publish=lambda *a, **k: None))
    # no engines to lend GPUs, a trainer without memory tags: the save itself, straight
    monkeypatch.setattr(ck, "lent_to_trainers", lambda job, version: contextlib.nullcontext())
    monkeypatch.setattr(ck, "OnGPUs", lambda job, group, tenant: group)
    if remote:  # the role said nothing of space: the free space of the folder's filesystem does
        monkeypatch.setattr(ck, "_free_bytes", lambda path: 4096)
    with pytest.raises(ck.SaveFailed) as failed:
        ck.save_if_due(job, 2, data=data, version=2)
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint rollout_00002 could not be written to {tmp_path / 'save'}: ")
    assert ("no space left on device (4096 bytes free; the writer said: RuntimeError: unexpected pos 1)" if remote
            else "No space left on device") in message
    assert message.endswith(f"the last complete checkpoint is rollout_00001: make room, then resume with "
                            f"--load {tmp_path / 'save'}")
    assert sorted(os.listdir(tmp_path / "save")) == ["latest", "rollout_00001"]
    assert locate(tmp_path, hf).step == 1


def test_a_checkpoint_from_before_manifests_is_taken_unverified_with_a_warning(tmp_path, trainers, data, hf, caplog):
    save(tmp_path, trainers, data, 1, hf)
    for folder in ("save", "save_critic"):
        (tmp_path / folder / "rollout_00001" / "MANIFEST.json").unlink()
    assert locate(tmp_path, hf).step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2 and all("has no MANIFEST.json (an older checkpoint)" in w for w in warnings)


def test_a_trainer_saves_and_loads_only_with_its_state_on_the_device(tmp_path, trainers, hf):
    """Every backend holds megatron's contract (it can do no other), so that the driver's
    checkpoint windows (ppo.gpu.handoffs) are exercised by every CPU run, not only on a GPU."""
    actor = ActorTrainer(trainer_config(hf))  # built offloaded
    for call in (actor.save, actor.load):
        with pytest.raises(RuntimeError, match=r"\['params', 'optimizer'\] offloaded; call onload"):
            call(str(tmp_path / "a"))
    trainers[0].save(str(tmp_path / "a"))
    actor.onload(["params"])
    with pytest.raises(RuntimeError, match=r"\['optimizer'\] offloaded"):
        actor.load(str(tmp_path / "a"))
    actor.onload(["optimizer"])
    actor.load(str(tmp_path / "a"))
    assert actor.weights_checksum() == trainers[0].weights_checksum()
