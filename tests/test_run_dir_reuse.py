"""Each way into a run dir, before anything is written (ppo/state/rundir.py): a plain rerun, --load
of another folder (empty, or another run's checkpoints), --load of a missing one, a finished
run and a killed one. No refused run changes a byte of the earlier run's files."""

import json
import os

import pytest

import launch
from ppo.config import ensure_valid, override
from ppo.config.recipes import tiny_ppo
from ppo.state.rundir import RunDirError, claim, load_problem


def _earlier_run(tmp_path, name="run", step=3):
    """A run dir that a run (killed or finished) logged to, and its --save folder with one checkpoint."""
    run, save = tmp_path / name, tmp_path / f"{name}-save"
    (run / "samples").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    (run / "events.jsonl").write_text('{"event": "ready"}\n')
    (run / "samples" / "rollout_0.jsonl").write_text('{"index": 0}\n')
    (run / ".lock").write_text("4242\n")  # its pid, long gone: the kernel dropped the flock
    ckpt = save / f"rollout_{step:05d}"
    ckpt.mkdir(parents=True)
    (ckpt / "driver_state.json").write_text(json.dumps({"rollout_step": step, "config": {"logging": {"run_dir": str(run)}}}))
    (save / "latest").write_text(ckpt.name)
    return run, save


def _files(*roots):
    return {str(p): p.read_bytes() for root in roots if root.exists() for p in sorted(root.rglob("*")) if p.is_file()}


def _refused(capsys, *args):
    """launch.py's stderr for `args`: one line, exit 2."""
    with pytest.raises(SystemExit) as stop:
        launch.main(list(args))
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("tandem: "), err
    return err


def test_a_plain_rerun_or_a_load_of_another_folder_is_refused_and_touches_nothing(tmp_path, capsys):
    run, save = _earlier_run(tmp_path)
    other_run, other_save = _earlier_run(tmp_path, "other")
    empty = tmp_path / "empty"
    empty.mkdir()
    before = _files(tmp_path)
    err = _refused(capsys, "--run-dir", str(run))
    assert f"--run-dir {run} holds an earlier run (metrics.jsonl, events.jsonl)" in err
    err = _refused(capsys, "--run-dir", str(run), "--load", str(empty), "--save", str(empty))
    assert f"--load {empty} holds no checkpoint to resume it from" in err
    err = _refused(capsys, "--run-dir", str(run), "--load", str(other_save))
    assert f"is another run's (written with --run-dir {other_run})" in err
    assert _files(tmp_path) == before  # 7 metrics lines, the samples, the lock file: as they were


def test_a_load_that_does_not_exist_is_one_line_before_anything_is_written(tmp_path, capsys):
    missing, run, save = tmp_path / "ckpt-typo", tmp_path / "new-run", tmp_path / "ckpt"
    err = _refused(capsys, "--run-dir", str(run), "--load", str(missing), "--save", str(save))
    assert err == (f"tandem: --load {missing}: no such folder; pass the --save folder of the run to resume, or "
                   "leave --load out to start a new run (or give --save the same folder, as miles' recipes do)\n")
    assert os.listdir(tmp_path) == []  # neither the run dir nor the --save folder was made
    (tmp_path / "file").write_text("")
    assert "not a folder" in _refused(capsys, "--run-dir", str(run), "--load", str(tmp_path / "file"))
    # miles' first run of a job: --load and --save on one folder that --save will make
    first = ensure_valid(override(tiny_ppo(), run_dir=str(run), load=str(save), save=str(save)))
    assert load_problem(first) is None


def test_a_finished_run_is_refused_unless_more_rollouts_are_asked_for(tmp_path, capsys):
    run, save = _earlier_run(tmp_path, step=3)
    before = _files(tmp_path)
    err = _refused(capsys, "--run-dir", str(run), "--load", str(save), "--num-rollout", "4")
    assert "its newest checkpoint is after rollout 3, and --num-rollout 4 leaves nothing to run" in err
    assert _files(tmp_path) == before
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(run), load=str(save), save=str(save), num_rollout=8))
    assert load_problem(cfg) is None
    claim(cfg).release()  # resuming the same run for more rollouts may go on


def test_a_killed_run_is_resumed_only_from_its_own_checkpoints(tmp_path):
    run, save = _earlier_run(tmp_path)
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(run), num_rollout=8))
    with pytest.raises(RunDirError, match="holds an earlier run"):
        claim(cfg)
    resumed = override(cfg, load=str(save), save=str(save))
    assert load_problem(resumed) is None
    lock = claim(resumed)  # the dead run's lock is free
    assert (run / ".lock").read_text() == f"{os.getpid()}\n"
    lock.release()
    assert (run / "metrics.jsonl").read_text().count("\n") == 7  # claiming trims nothing: resume trims after its checkpoint
    # a folder with no checkpoint yet starts a new run, but only in a run dir with no earlier run
    fresh = override(cfg, run_dir=str(tmp_path / "fresh"), load=str(tmp_path / "empty"), save=str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    assert load_problem(fresh) is None
    claim(fresh).release()


def test_a_save_folder_holding_another_runs_checkpoints_is_refused_and_touches_nothing(tmp_path, capsys):
    run, save = _earlier_run(tmp_path)
    other_run, other_save = _earlier_run(tmp_path, "other")
    new_run = tmp_path / "new-run"
    before = _files(tmp_path)
    err = _refused(capsys, "--run-dir", str(new_run), "--save", str(save))  # a new run onto old checkpoints
    assert f"--save {save} holds an earlier run's checkpoints (latest, rollout_00003), and this run starts anew" in err
    err = _refused(capsys, "--run-dir", str(new_run), "--load", str(other_save), "--save", str(save))
    assert f"this run starts from --load {other_save}" in err
    # --load and --save one folder, but another run's: a new run dir would save over that run
    err = _refused(capsys, "--run-dir", str(new_run), "--load", str(save), "--save", str(save), "--num-rollout", "8")
    assert f"written with --run-dir {run}: this run's saves would overwrite and prune them" in err
    assert _files(tmp_path) == before and not new_run.exists()
    # the run's own resume (miles' recipes: one folder for both), and a new run saving elsewhere, go on
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(run), load=str(save), save=str(save), num_rollout=8))
    assert load_problem(cfg) is None
    assert load_problem(override(cfg, run_dir=str(new_run), save=str(tmp_path / "new-save"))) is None


def test_a_run_started_with_a_relative_run_dir_is_resumed_from_another_working_directory(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from ppo.state.checkpoint import driver_state

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "job").mkdir()
    monkeypatch.chdir(tmp_path / "job")
    cfg = ensure_valid(override(tiny_ppo(), run_dir="runs/a", save="ck", num_rollout=8))
    state = driver_state(cfg, 3, data=SimpleNamespace(state_dict=lambda: {}), version=3,
                         hf_checkpoint=str(tmp_path / "hf"))
    run, save = tmp_path / "job" / "runs" / "a", tmp_path / "job" / "ck"
    (save / "rollout_00003").mkdir(parents=True)
    (save / "rollout_00003" / "driver_state.json").write_text(json.dumps(state))
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)  # the resume, from elsewhere, names the same folders
    resumed = override(cfg, run_dir=str(run), load=str(save), save=str(save))
    assert load_problem(resumed) is None
    claim(resumed).release()
