"""The command line as users see it, held against files in tests/snapshots/.

`python launch.py --help`, `--list-recipes` and each recipe's `--dry-run` (the resolved config,
the derived values and the GPU placement) must not change when the code behind them moves: a
flag renamed, a default changed or a recipe lost shows up here as a diff. When a change is
meant, regenerate the files and review their diff:

    TANDEM_UPDATE_SNAPSHOTS=1 pytest tests/test_cli_snapshot.py

launch.py runs as a subprocess, as a user runs it, so the test does not depend on where the
code behind it lives; a dry run starts nothing, and imports torch only for a megatron recipe
(its trainer config: ~4 s; the others ~0.7 s).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "tests" / "snapshots"
UPDATE = os.environ.get("TANDEM_UPDATE_SNAPSHOTS") == "1"
REGENERATE = "TANDEM_UPDATE_SNAPSHOTS=1 pytest tests/test_cli_snapshot.py"

# argparse wraps its help to the terminal's width (shutil.get_terminal_size reads COLUMNS);
# colour (Python 3.14's argparse) and the interpreter's own warnings would differ by machine.
ENV = {**os.environ, "COLUMNS": "100", "LINES": "50", "NO_COLOR": "1", "PYTHON_COLORS": "0",
       "PYTHONWARNINGS": "ignore"}


def normalise(text: str) -> str:
    """What depends on the machine or the clock, replaced by a fixed token."""
    text = re.sub(r"-\d{8}-\d{6}", "-<date>-<time>", text)  # the default run_dir (ppo/config/cli.py)
    text = text.replace(str(REPO), "<repo>")
    return text.replace("optional arguments:", "options:")  # argparse's heading before Python 3.10


def launch(*args: str) -> str:
    proc = subprocess.run([sys.executable, "launch.py", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"launch.py {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}"
    out = proc.stdout if not proc.stderr else f"{proc.stdout}--- stderr ---\n{proc.stderr}"
    return normalise(out)


def check(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    assert path.exists(), f"no snapshot {path.relative_to(REPO)}; take it with: {REGENERATE}"
    expected = path.read_text()
    if text != expected:  # the first differing line, since pytest's diff of 500 lines is unreadable
        new, old = text.splitlines(), expected.splitlines()
        i = next((i for i, (a, b) in enumerate(zip(new, old)) if a != b), min(len(new), len(old)))
        pytest.fail(f"`launch.py` output differs from {path.relative_to(REPO)} at line {i + 1}:\n"
                    f"  snapshot: {old[i] if i < len(old) else '<end>'}\n"
                    f"  now:      {new[i] if i < len(new) else '<end>'}\n"
                    f"if the change is meant, regenerate and review the diff: {REGENERATE}")


def recipes() -> list[str]:
    """The recipe names, as `--list-recipes` prints them (one `name  summary` line each)."""
    return [line.split()[0] for line in launch("--list-recipes").splitlines() if line.strip()]


@pytest.mark.timeout(60)
def test_help_is_unchanged():
    check("help", launch("--help"))


@pytest.mark.timeout(60)
def test_recipe_list_is_unchanged():
    check("list-recipes", launch("--list-recipes"))


@pytest.mark.timeout(60)
def test_every_recipe_dry_run_is_unchanged():
    """One snapshot per recipe, and no snapshot for a recipe that is gone."""
    names = recipes()
    for name in names:
        check(f"dry-run-{name}", launch("--recipe", name, "--dry-run"))
    taken = {p.stem.removeprefix("dry-run-"): p for p in SNAPSHOTS.glob("dry-run-*.txt")}
    gone = sorted(set(taken) - set(names))
    if UPDATE:
        for name in gone:
            taken[name].unlink()
        return
    assert not gone, f"snapshots of recipes that are gone: {gone}; if meant: {REGENERATE}"
