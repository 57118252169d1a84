"""launch.py: dry run, recipe list, exit code 2 on bad config, lazy training entry."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

import launch
from ppo.config.serialize import override
from ppo.config import from_dict
from ppo.config.recipes import RECIPES, qwen3_4b_ppo, tiny_ppo

REPO = Path(__file__).resolve().parents[1]


def run_launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_gpus_per_node, dp", [(None, 1), (8, 2)])
def test_dry_run_places_qwen_as_miles_ships_it(num_gpus_per_node, dp):
    """TP1 x PP2 x CP2 over the node's 4 GPUs is one data-parallel rank, the critic in the
    actor's layout; --num-gpus-per-node 8 gives two."""
    flags = () if num_gpus_per_node is None else ("--num-gpus-per-node", str(num_gpus_per_node))
    proc = run_launch("--recipe", "qwen3_4b_ppo", *flags, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    # the recipe carries miles' --ref-load; the launcher says it is not read and what is instead
    assert "--ref-load /root/models/Qwen3-4B_torch_dist is not read: the trainers start from --hf-checkpoint" \
        in proc.stderr
    resolved, end = json.JSONDecoder().raw_decode(proc.stdout)
    cfg = from_dict(resolved["config"])
    assert cfg.logging.run_dir.startswith("runs/qwen3_4b_ppo-")
    changed = {} if num_gpus_per_node is None else {"num_gpus_per_node": num_gpus_per_node}
    assert cfg == override(qwen3_4b_ppo(), run_dir=cfg.logging.run_dir, **changed)
    derived = resolved["derived"]
    assert derived["uses_critic"] and not derived["needs_ref"] and derived["offload_train"]
    gpus = 4 * dp
    assert (derived["num_engines"], derived["data_parallel_size"]) == (gpus, dp)
    assert derived["critic_optimizer"]["lr"] == 1e-5 and derived["actor_optimizer"]["lr"] == 1e-6
    rows = [line.split() for line in proc.stdout[end:].strip().splitlines()]
    for role in ("actor", "critic"):
        (row,) = [r for r in rows if r[0] == role]
        assert row[:3] == [role, f"0-{gpus - 1}", "0"]
        assert " ".join(row[3:]).endswith(f"tp 1 x pp 2 x cp 2 x dp {dp}")
    engines = [row[:4] for row in rows if row[0] == "engine"]
    assert engines == [["engine", str(i), str(i), "0"] for i in range(gpus)]


@pytest.mark.timeout(60)
def test_list_recipes_prints_names_and_summaries():
    proc = run_launch("--list-recipes")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(RECIPES)
    for line, fn in zip(lines, RECIPES.values()):
        assert line.endswith(fn.__doc__.strip().splitlines()[0])


@pytest.mark.timeout(60)
def test_unknown_flag_exits_2_listing_every_problem():
    proc = run_launch("--no-such-flag", "3", "--lr", "x", "--dry-run")
    assert proc.returncode == 2
    assert proc.stdout == ""  # nothing resolved, nothing started
    assert "--no-such-flag: unknown flag" in proc.stderr
    assert "--lr 'x' (optimizer.lr): expected a float" in proc.stderr
    assert "2 problems" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_without_a_recipe_resolves_tiny_ppo(capsys):
    launch.main(["--dry-run", "--lr", "5e-4"])
    out = capsys.readouterr().out
    resolved, _ = json.JSONDecoder().raw_decode(out)
    assert from_dict(resolved["config"]).optimizer.lr == 5e-4
    assert "fake GPUs" in out


def test_a_dry_run_of_a_generated_model_imports_neither_torch_nor_transformers():
    """Its memory plan is sized from plain config fields (ppo.model_shapes), so it answers in a
    fraction of a second rather than the seconds those imports take."""
    code = ("import runpy, sys\nsys.argv = ['launch.py', '--recipe', 'tiny_ppo', '--dry-run']\n"
            "try:\n    runpy.run_path('launch.py', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code\n"
            "print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "imported: []"
    assert "memory plan, GiB per GPU" in out.stdout


def test_without_dry_run_the_config_goes_to_ppo_loop_train(monkeypatch):
    received = []
    loop = types.ModuleType("ppo.loop")
    loop.train = lambda cfg, sm=None: received.append(cfg)
    loop.TrainerDied = RuntimeError
    job = types.ModuleType("ppo.setup.job")
    job.JobSetupError = ValueError
    monkeypatch.setitem(sys.modules, "ppo.setup.job", job)
    monkeypatch.setitem(sys.modules, "ppo.loop", loop)
    launch.main([])
    assert received == [override(tiny_ppo(), run_dir=received[0].logging.run_dir)]


def test_config_error_exits_2_before_training(monkeypatch, capsys):
    loop = types.ModuleType("ppo.loop")
    loop.train = lambda cfg: pytest.fail("training started on an invalid config")
    monkeypatch.setitem(sys.modules, "ppo.loop", loop)
    with pytest.raises(SystemExit) as info:
        launch.main(["--rollout-batch-size", "0"])
    assert info.value.code == 2
    assert "--rollout-batch-size 0" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_the_headline_recipe_passes_its_layout_and_stops_at_the_machine(tmp_path):
    """qwen3_4b_ppo's PP2 layout is accepted; on this machine (no GPU, no sglang, no
    megatron-core) the next checks stop it before anything starts: one line, exit 2, no run
    directory."""
    run_dir = tmp_path / "run"
    for flags, stop in (((), "rollout backend 'sglang' needs"),
                        (("--rollout-backend", "torch"), "--train-backend megatron cannot run here")):
        proc = run_launch("--recipe", "qwen3_4b_ppo", "--run-dir", str(run_dir), *flags)
        assert proc.returncode == 2, proc.stderr
        assert stop in proc.stderr and "Traceback" not in proc.stderr
        assert "layout" not in proc.stderr and "pipeline" not in proc.stderr
        assert not run_dir.exists()


def test_a_layout_the_model_cannot_split_stops_before_anything_starts(ckpt):
    """Uneven pipeline stages are not built: refused from --hf-checkpoint's config.json,
    naming the flag and the layer count (the tiny Qwen3 has 2 layers)."""
    from ppo.setup.job import trainer_layout_problem

    cfg = override(qwen3_4b_ppo(), hf_checkpoint=ckpt)
    assert trainer_layout_problem(cfg) is None  # PP2 splits 2 layers
    uneven = override(cfg, pipeline_model_parallel_size=4, context_parallel_size=1)
    assert trainer_layout_problem(uneven) == (
        "--train-backend megatron cannot run this run's layout: --pipeline-model-parallel-size 4 must divide "
        "num_hidden_layers=2 (uneven pipeline stages are not built)")


def test_a_checkpoint_tensor_the_model_has_no_place_for_stops_before_anything_starts(ckpt, tmp_path):
    """A q bias in a checkpoint whose config has none (another architecture's tensors): named
    from the safetensors headers before start, as the trainers' loader would refuse it."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from ppo.setup.job import trainer_layout_problem

    model = shutil.copytree(ckpt, tmp_path / "model")
    save_file({"model.layers.1.self_attn.q_proj.bias": torch.zeros(4)}, str(model / "extra.safetensors"))
    problem = trainer_layout_problem(override(qwen3_4b_ppo(), hf_checkpoint=str(model)))
    assert problem.startswith(f"--hf-checkpoint {model}: checkpoint tensor 'model.layers.1.self_attn.q_proj.bias' "
                              "has no place in the qwen3 model its config describes"), problem


def test_an_unreadable_model_config_is_named_as_such_not_as_a_layout(tmp_path):
    from ppo.setup.job import trainer_layout_problem

    (tmp_path / "config.json").write_text("{not json")
    problem = trainer_layout_problem(override(qwen3_4b_ppo(), hf_checkpoint=str(tmp_path)))
    assert problem.startswith(f"--hf-checkpoint {tmp_path}: its config.json is not a model the megatron trainer builds")
    assert "layout" not in problem


@pytest.mark.timeout(60)
def test_every_setup_problem_is_reported_at_once_before_anything_starts(tmp_path):
    """The headline command on a machine without the model, sglang or megatron-core: one
    message lists each problem with its fix; no run directory is made."""
    run_dir = tmp_path / "run"
    proc = run_launch("--recipe", "qwen3_4b_ppo", "--hf-checkpoint", str(tmp_path / "no-model"),
                      "--run-dir", str(run_dir))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "problems stop this run (nothing was started)" in proc.stderr
    assert f"--hf-checkpoint {tmp_path / 'no-model'}: no such directory" in proc.stderr
    assert "python -m ppo.make_model --arch qwen3-4b DIR" in proc.stderr
    assert "rollout backend 'sglang' needs" in proc.stderr and "--train-backend megatron cannot run here" in proc.stderr
    assert not run_dir.exists()


def test_a_directory_without_config_json_is_not_an_hf_checkpoint(tmp_path):
    from ppo.setup.job import hf_checkpoint_problem

    problem = hf_checkpoint_problem(override(tiny_ppo(), hf_checkpoint=str(tmp_path)))
    assert problem.startswith(f"--hf-checkpoint {tmp_path}: not an HF checkpoint (no config.json)")
    (tmp_path / "config.json").write_text("{}")
    assert hf_checkpoint_problem(override(tiny_ppo(), hf_checkpoint=str(tmp_path))) is None
    assert hf_checkpoint_problem(tiny_ppo()) is None  # generated:tiny-qwen3 is built at start
