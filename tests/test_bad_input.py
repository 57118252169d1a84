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
        from ppo.data import PromptDataset
        from ppo.tiny_model import load_tokenizer
        data = PromptDataset(prompts, input_key="prompt", label_key="label", tokenizer=load_tokenizer(tiny_checkpoint),
                             max_prompt_len=MAX_PROMPT_LEN, skip_bad_samples=True)
        assert [line for line, _ in data.skipped] == list(range(len(GOOD) + 1, len(GOOD) + len(BAD) + 1))


def test_every_bad_line_kind_names_its_file_and_line(tmp_path, tiny_checkpoint):
    """The same check the launcher reaches, for each kind of bad line (no processes)."""
    from ppo.data import PromptDataset
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
