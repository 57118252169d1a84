"""Signals to a run (ppo.state.signals) through the real launcher, in a subprocess: Ctrl-C and
SIGTERM stop at once with one line and exit 128 + the signal, leaving no process and
supervisor.json marked ended; SIGUSR1 saves at the end of the rollout under way and stops,
and the resumed run repeats the uninterrupted one bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from ppo.tiny_model import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) for a in range(5) for b in range(5)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "prompts.jsonl").write_text("\n".join(PROMPTS) + "\n")
    return build_tiny_checkpoint(str(d / "tiny"), seed=0), d / "prompts.jsonl"


def args(inputs, run_dir: Path, *more: str) -> list[str]:
    """A short run on one fake GPU: the signals are the driver's, so one actor rank, one critic
    rank and one engine show them as two would, and start in half the time (a role process
    spends seconds importing torch and transformers)."""
    ckpt, prompts = inputs
    return ["--hf-checkpoint", ckpt, "--prompt-data", str(prompts), "--input-key", "prompt", "--label-key", "label",
            "--run-dir", str(run_dir), "--num-rollout", "6", "--num-critic-only-steps", "0",
            "--num-gpus-per-node", "1", "--actor-num-gpus-per-node", "1",
            "--rollout-batch-size", "8", "--global-batch-size", "64", "--micro-batch-size", "32", "--quiet", *more]


class Launch:
    """launch.py in a subprocess, marked through its environment so that what it leaves is found."""

    def __init__(self, argv: list[str], cwd: Path):
        self.mark = uuid.uuid4().hex
        env = dict(os.environ, TANDEM_TEST_MARK=self.mark, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), *argv], cwd=cwd, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(self, ready, timeout: float = 200) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, self.proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "timed out waiting for the run"
            time.sleep(0.2)

    def finish(self, timeout: float = 200) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        left = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("TANDEM_TEST_MARK") == self.mark and p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, p.cmdline()))
            except psutil.Error:
                pass
        assert not left, f"launch.py left processes running: {left}"
        return self.proc.returncode, err


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [m["step"] for m in lines if not any(k.startswith("eval/") for k in m)]  # rollouts, not evals


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_at_once_in_one_line_and_leave_nothing(tmp_path, inputs, signum):
    run_dir = tmp_path / "run"
    run = Launch(args(inputs, run_dir), tmp_path)
    run.wait_for(lambda: steps_logged(run_dir))  # mid-run: rollout 0 is logged
    run.proc.send_signal(signum)
    code, err = run.finish()
    assert code == 128 + signum, err[-3000:]
    name = signal.Signals(signum).name
    assert err.splitlines()[-1].startswith(f"tandem: stopped by {name} during rollout "), err[-3000:]
    assert err.splitlines()[-1].endswith("no checkpoint was being written (--save unset): the run must start over")
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert "ended" in json.loads((run_dir / "supervisor.json").read_text())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_stopped_by_sigusr1_and_resumed_repeats_the_uninterrupted_one(tmp_path, inputs):
    code, err = Launch(args(inputs, tmp_path / "straight"), tmp_path).finish()
    assert code == 0, err[-3000:]

    run_dir, save = tmp_path / "run", tmp_path / "ck"
    run = Launch(args(inputs, run_dir, "--save", str(save)), tmp_path)
    run.wait_for(lambda: steps_logged(run_dir))
    run.proc.send_signal(signal.SIGUSR1)
    code, err = run.finish()
    assert code == 128 + signal.SIGUSR1, err[-3000:]
    saved = (save / "latest").read_text().strip()
    step = int(saved.split("_")[1])
    lines = err.splitlines()
    assert lines[0] == f"tandem: SIGUSR1: saving a checkpoint at the end of rollout {step}, then stopping"
    assert lines[1].startswith(f"tandem: SIGUSR1: saved {saved} after rollout {step} and stopped; resume with: "
                               "python launch.py "), err
    assert steps_logged(run_dir) == list(range(step + 1)) and step < 5

    resume = lines[1].split("resume with: python launch.py ")[1].split()  # the command it printed
    assert resume[-4:] == ["--load", str(save), "--run-dir", str(run_dir)]
    code, err = Launch(resume, tmp_path).finish()
    assert code == 0, err[-3000:]

    def metrics(d):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert metrics(run_dir) == metrics(tmp_path / "straight")  # every step, bit for bit


def test_the_resume_command_is_the_run_s_own_with_load_and_run_dir_in_place():
    from ppo.config import override
    from ppo.config.recipes import tiny_ppo
    from ppo.state.signals import resume_command
    cfg = override(tiny_ppo(), save="ck dir", run_dir="runs/a")
    assert resume_command(["--num-rollout", "3", "--load=old", "--run-dir", "runs/a", "--save", "ck dir"], cfg) == \
        "python launch.py --num-rollout 3 --save 'ck dir' --load 'ck dir' --run-dir runs/a"
