"""Bad user input through the real launcher (`python launch.py ...` in a subprocess): bad
prompt data and bad configuration end with a message naming the problem, a non-zero exit,
and no process left running.

Prompt-data lines are checked when the driver builds its PromptDataset (`ppo.loop.run`), after
the roles have started; a bad line shuts them down again. Configuration errors stop in
`parse_cli`, before anything starts or any run directory is made.
"""

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from ppo.tiny_model import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GOOD = [json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) for a in range(4) for b in range(4)]
MAX_PROMPT_LEN = 8
# (line text, what the error says about it); GOOD fills lines 1-16, these are lines 17-21
BAD = [
    ('{"prompt": "1+2=", "label": "3"', "malformed JSON"),
    (json.dumps({"prompt": "   ", "label": "0"}), "empty prompt"),
    (json.dumps({"prompt": "1+2+3+4+5+6=", "label": "21"}), f"more than max_prompt_len={MAX_PROMPT_LEN}"),
    (json.dumps({"question": "1+1=", "label": "2"}), "missing prompt key 'prompt'"),
    ("[1, 2]", "expected a JSON object"),
]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    # A prebuilt checkpoint: `generated:tiny-qwen3` would read the prompt file itself first.
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny"), seed=0)


def write_prompts(path: Path, bad_lines: list[str]) -> Path:
    path.write_text("\n".join(GOOD + bad_lines) + "\n")
    return path


def launch(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run launch.py; afterwards no process it started (marked through the environment) is alive."""
    mark = uuid.uuid4().hex
    env = dict(os.environ, TANDEM_TEST_MARK=mark, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)
    left = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TANDEM_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE:
                left.append((p.pid, p.cmdline()))
        except psutil.Error:
            pass
    assert not left, f"launch.py left processes running: {left}"
    return proc


def tiny_args(ckpt: str, prompts: Path, run_dir: Path) -> list[str]:
    return ["--hf-checkpoint", ckpt, "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--num-rollout", "1", "--num-critic-only-steps", "0", "--rollout-batch-size", "8", "--global-batch-size", "64",
            "--micro-batch-size", "32", "--rollout-max-prompt-len", str(MAX_PROMPT_LEN), "--no-rollout-shuffle"]


@pytest.mark.slow  # the roles start before the driver reads the data
@pytest.mark.timeout(180)
def test_bad_prompt_line_exits_nonzero_naming_file_and_line_and_leaves_no_process(tmp_path, tiny_checkpoint):
    text, reason = BAD[2]  # too long for --rollout-max-prompt-len
    prompts = write_prompts(tmp_path / "BAD.jsonl", [text])
    proc = launch(tiny_args(tiny_checkpoint, prompts, tmp_path / "run"), tmp_path, timeout=150)
    assert proc.returncode != 0
    assert f"{prompts}:{len(GOOD) + 1}: prompt has 12 tokens, {reason}" in proc.stderr, proc.stderr[-3000:]
    assert "skip" in proc.stderr.splitlines()[-1]  # says how to skip such lines


@pytest.mark.slow  # the roles start before the driver opens the file
@pytest.mark.timeout(180)
def test_missing_prompt_file_exits_nonzero_naming_it(tmp_path, tiny_checkpoint):
    missing = tmp_path / "nope.jsonl"
    proc = launch(tiny_args(tiny_checkpoint, missing, tmp_path / "run"), tmp_path, timeout=150)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr.splitlines()[-1], proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_skip_bad_samples_trains_on_the_rest_and_counts_them(tmp_path, tiny_checkpoint):
    prompts = write_prompts(tmp_path / "BAD.jsonl", [text for text, _ in BAD])
    run_dir = tmp_path / "run"
    proc = launch(tiny_args(tiny_checkpoint, prompts, run_dir) + ["--skip-bad-samples"], tmp_path, timeout=210)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "eval/weight_version" not in m]  # tiny_ppo's eval before step 0
    assert len(metrics) == 1
    samples = [json.loads(line) for line in (run_dir / "samples" / "rollout_00000.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} <= {json.loads(g)["prompt"] for g in GOOD}
    flat = {**metrics[0], **metrics[0].get("metrics", {})}
    if "rollout/skipped_samples" in flat:  # once the driver logs it
        assert flat["rollout/skipped_samples"] == len(BAD)
    else:
        from ppo.prompts.dataset import PromptDataset
        from ppo.tiny_model import load_tokenizer
        data = PromptDataset(prompts, input_key="prompt", label_key="label", tokenizer=load_tokenizer(tiny_checkpoint),
                             max_prompt_len=MAX_PROMPT_LEN, skip_bad_samples=True)
        assert [line for line, _ in data.skipped] == list(range(len(GOOD) + 1, len(GOOD) + len(BAD) + 1))


def test_every_bad_line_kind_names_its_file_and_line(tmp_path, tiny_checkpoint):
    """The same check the launcher reaches, for each kind of bad line (no processes)."""
    from ppo.prompts.dataset import PromptDataset
    from ppo.tiny_model import load_tokenizer
    tok = load_tokenizer(tiny_checkpoint)
    for text, reason in BAD:
        prompts = write_prompts(tmp_path / "BAD.jsonl", [text])
        with pytest.raises(ValueError, match=f"^{prompts}:{len(GOOD) + 1}: .*{reason}"):
            PromptDataset(prompts, input_key="prompt", label_key="label", tokenizer=tok, max_prompt_len=MAX_PROMPT_LEN)


# --- configuration ------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_config_problems_of_every_kind_come_in_one_message_exit_2_and_start_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(["--rollout-batchsize", "8",           # unknown flag (a typo)
                   "--num-rollout", "three",             # wrong type
                   "--eps-clip", "1.5",                  # out of range
                   "--rollout-num-gpus", "3",            # colocated engines on 3 of the actor's 2 GPUs
                   "--run-dir", str(run_dir)], tmp_path, timeout=50)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("invalid configuration (4 problems)"), proc.stderr
    message = "\n".join(lines)
    assert "--rollout-batchsize: unknown flag; did you mean --rollout-batch-size?" in message
    assert "--num-rollout 'three' (rollout.num_rollout): expected an int" in message
    assert "--eps-clip 1.5 (ppo.eps_clip): must be in (0.0, 1.0)" in message
    assert "--rollout-num-gpus 3 (placement.rollout_num_gpus): with --colocate the engines run on the actor's 2 GPUs" in message
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


# --- prompts against the model's context ----------------------------------------------------

LONG = json.dumps({"prompt": "1+" * 40 + "1=", "label": "41"})  # 82 tokens; the tiny model's context is 64


def context_args(ckpt: str, prompts: Path, run_dir: Path) -> list[str]:
    return ["--hf-checkpoint", ckpt, "--prompt-data", str(prompts), "--run-dir", str(run_dir),
            "--num-rollout", "2", "--num-critic-only-steps", "0", "--rollout-batch-size", "8",
            "--global-batch-size", "64", "--micro-batch-size", "32", "--no-rollout-shuffle"]


@pytest.mark.timeout(120)
def test_prompt_longer_than_the_context_is_refused_at_load_naming_file_line_and_lengths(tmp_path, tiny_checkpoint):
    prompts = write_prompts(tmp_path / "LONG.jsonl", [LONG])
    proc = launch(context_args(tiny_checkpoint, prompts, tmp_path / "run"), tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert lines[-1].startswith(f"tandem: {prompts}:{len(GOOD) + 1}: prompt has 82 tokens; with 4 response tokens "
                                "that is 86, more than the model's context of 64"), proc.stderr[-3000:]
    assert "--skip-bad-samples" in lines[-1]
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no role started


def test_skip_bad_samples_skips_and_counts_prompts_longer_than_the_context(tmp_path, tiny_checkpoint):
    """The same check, skipping (what the launcher builds with --skip-bad-samples; no processes)."""
    from ppo.prompts.dataset import PromptDataset
    from ppo.tiny_model import load_tokenizer
    prompts = write_prompts(tmp_path / "LONG.jsonl", [LONG])
    data = PromptDataset(prompts, input_key="prompt", label_key="label", tokenizer=load_tokenizer(tiny_checkpoint),
                         context_len=64, response_len=4, skip_bad_samples=True)
    assert len(data) == len(GOOD) and data.num_skipped == 1
    assert data.skipped[0][0] == len(GOOD) + 1 and "context of 64" in data.skipped[0][1]


@pytest.mark.timeout(60)
def test_prompt_and_response_flags_beyond_the_context_are_refused_before_anything_is_written(tmp_path,
                                                                                           tiny_checkpoint):
    prompts = write_prompts(tmp_path / "ok.jsonl", [])
    run_dir = tmp_path / "run"
    proc = launch(context_args(tiny_checkpoint, prompts, run_dir)
                  + ["--rollout-max-prompt-len", "40", "--rollout-max-response-len", "30"], tmp_path, timeout=50)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("--rollout-max-prompt-len 40 + --rollout-max-response-len 30 = 70 tokens, more than the model's "
            "context of 64") in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()


# --- the run directory ---------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_second_run_on_a_live_run_dir_is_refused_in_one_line_and_touches_nothing(tmp_path, tiny_checkpoint):
    from ppo.config import ensure_valid, override
    from ppo.config.recipes import tiny_ppo
    from ppo.state.rundir import claim
    run_dir = tmp_path / "run"
    live = claim(ensure_valid(override(tiny_ppo(), run_dir=str(run_dir))))  # "the live run"
    try:
        (run_dir / "config.json").write_text("the live run's")
        prompts = write_prompts(tmp_path / "ok.jsonl", [])
        proc = launch(context_args(tiny_checkpoint, prompts, run_dir), tmp_path, timeout=50)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.splitlines() == [f"tandem: --run-dir {run_dir} is in use by a live run (pid {os.getpid()}); "
                                            "wait for it to end, or pass another --run-dir"]
        assert (run_dir / "config.json").read_text() == "the live run's"
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.json"]
    finally:
        live.release()


@pytest.mark.timeout(60)
def test_an_ended_runs_dir_is_not_appended_to_without_load(tmp_path, tiny_checkpoint):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    prompts = write_prompts(tmp_path / "ok.jsonl", [])
    proc = launch(context_args(tiny_checkpoint, prompts, run_dir) + ["--save", str(tmp_path / "ck")],
                  tmp_path, timeout=50)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"tandem: --run-dir {run_dir} holds an earlier run (metrics.jsonl); resume it with --load {tmp_path / 'ck'}, "
        "or pass a new --run-dir to start another run"]
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n' and not (run_dir / "config.json").exists()


def test_the_run_dir_lock_goes_with_its_release(tmp_path):
    from ppo.config import ensure_valid, override
    from ppo.config.recipes import tiny_ppo
    from ppo.state.rundir import RunDirError, claim
    cfg = ensure_valid(override(tiny_ppo(), run_dir=str(tmp_path / "run")))
    first = claim(cfg)
    with pytest.raises(RunDirError, match="in use by a live run"):
        claim(cfg)
    first.release()
    claim(cfg).release()
    with pytest.raises(RunDirError, match="cannot be used"):  # a folder under a regular file
        (tmp_path / "file").write_text("")
        claim(override(cfg, run_dir=str(tmp_path / "file" / "run")))


# --- a damaged --load checkpoint -------------------------------------------------------------

class FileSaver:
    """Writes a trainer's three files (their contents do not matter before the roles start)."""

    def save(self, path):
        from roles.trainer.checkpoint import TRAINER_FILES
        os.makedirs(path, exist_ok=True)
        for name in TRAINER_FILES:
            Path(path, name).write_bytes(os.urandom(4096))


@pytest.mark.timeout(120)
def test_load_with_no_intact_checkpoint_is_refused_in_one_line_before_any_role_starts(tmp_path, tiny_checkpoint):
    from ppo.state import checkpoint as ck
    save = tmp_path / "ck"
    state = {"format": ck.FORMAT, "rollout_step": 0, "model": ck.model_signature(tiny_checkpoint)}
    ck.save_checkpoint(str(save), 0, actor=FileSaver(), state=state, critic=FileSaver(),
                       critic_dir=str(tmp_path / "ck_critic"))
    with open(save / "rollout_00000" / "optimizer.pt", "r+b") as f:
        f.truncate(1000)
    prompts = write_prompts(tmp_path / "ok.jsonl", [])
    proc = launch(context_args(tiny_checkpoint, prompts, tmp_path / "run") + ["--load", str(save)], tmp_path,
                  timeout=50)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"tandem: --load {save}: {save}/rollout_00000/optimizer.pt has 1000 bytes, "
                                        "4096 were written (truncated?); nothing to resume from"]
    assert not (tmp_path / "run" / "events.jsonl").exists()


# --- folders that cannot be written ------------------------------------------------------------

@pytest.mark.timeout(60)
def test_unwritable_save_and_run_dirs_are_refused_in_one_line_naming_the_path(tmp_path, tiny_checkpoint):
    (tmp_path / "file").write_text("")  # a path under a regular file: unwritable even for root
    prompts = write_prompts(tmp_path / "ok.jsonl", [])
    proc = launch(context_args(tiny_checkpoint, prompts, tmp_path / "file" / "run"), tmp_path, timeout=50)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"tandem: --run-dir {tmp_path}/file/run: cannot be used (Not a directory); "
                                        "pass a folder this user can write"]
    proc = launch(context_args(tiny_checkpoint, prompts, tmp_path / "run") + ["--save", str(tmp_path / "file" / "ck")],
                  tmp_path, timeout=50)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"--save {tmp_path}/file/ck: cannot be written (Not a directory)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (root only): too small for a checkpoint of the tiny model."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_at_the_save_stops_the_run_in_one_line_and_leaves_no_partial_checkpoint(
        tmp_path, tiny_checkpoint, tiny_disk):
    prompts = write_prompts(tmp_path / "ok.jsonl", [])
    save = tiny_disk / "ck"
    proc = launch(context_args(tiny_checkpoint, prompts, tmp_path / "run")
                  + ["--save", str(save), "--save-interval", "1"], tmp_path, timeout=280)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("tandem: checkpoint rollout_00000 could not be written to ")
    assert "no space left on device" in proc.stderr.lower()
    assert sorted(os.listdir(save)) == [] and not (save / "latest").exists()  # nothing half-written is left


@pytest.mark.timeout(120)
def test_bad_eval_set_line_exits_2_naming_file_and_line_before_anything_starts(tmp_path, tiny_checkpoint):
    """--eval-prompt-data is read where --prompt-data is, before any role starts: a bad line
    stops the run the same way (FILE:LINE, exit 2) and no process or role was spawned."""
    prompts = write_prompts(tmp_path / "GOOD.jsonl", [])
    held_out = write_prompts(tmp_path / "HELDOUT.jsonl", [BAD[0][0]])
    run_dir = tmp_path / "run"
    proc = launch(tiny_args(tiny_checkpoint, prompts, run_dir)
                  + ["--eval-prompt-data", "sums", str(held_out), "--eval-interval", "1"], tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(f"tandem: {held_out}:{len(GOOD) + 1}: {BAD[0][1]}"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "events.jsonl").exists() or "spawned" not in (run_dir / "events.jsonl").read_text()


# --- the tool loop's tool specs and function (ppo.generate.tools, roles.tools.specs) ----------

@pytest.mark.timeout(120)
def test_bad_tool_function_exits_2_in_one_line_before_anything_is_written(tmp_path, tiny_checkpoint):
    """Through the launcher once (each start costs ~20 s here); every other bad spec and function is
    refused by the same load_tool_setup (tests/test_generate_tools.py, tests/test_tools_specs.py)."""
    (tmp_path / "tools.py").write_text("async def run(name):\n    return ''\n")
    prompts = write_prompts(tmp_path / "p.jsonl", [])
    run_dir = tmp_path / "run"
    proc = launch(tiny_args(tiny_checkpoint, prompts, run_dir) + [
        "--generate-tool-specs-path", "roles.tools.calculator:TOOL_SPECS",
        "--generate-execute-tool-function-path", f"{tmp_path}/tools.py:run"], tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (f"tandem: --generate-execute-tool-function-path {tmp_path}/tools.py:run: "
                                   "run(name) cannot be called with (name, arguments); a tool function takes "
                                   "(name: str, arguments: dict) and returns a str, as miles' execute_tool_call")
    assert not run_dir.exists()
