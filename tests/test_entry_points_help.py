"""Every command-line entry point (a module with `if __name__ == "__main__":`, found by
scanning the tree) prints its help for `--help` and exits 0. Run in-process, as
`python -m MODULE --help` would run it (runpy), so the test costs the imports once."""

import contextlib
import io
import re
import runpy
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN_GUARD = re.compile(r'^if __name__ == "__main__":', re.M)
SKIP = {"tests", "runs"}  # and hidden folders: .venv, .git, copies made for a GPU run


def entry_points() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or rel.parts[0] in SKIP and rel.parts[:2] != ("tests", "fakes"):
            continue
        if MAIN_GUARD.search(path.read_text(errors="replace")):
            found.append(".".join(rel.with_suffix("").parts))
    return found


def test_the_scan_finds_the_known_entry_points():
    found = entry_points()
    assert {"launch", "ppo.evaluate", "ppo.make_model", "ppo.plot", "runtime.monitor", "bench.faults",
            "tests.fakes.gen_server_args"} <= set(found), found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("module", entry_points())
def test_help_prints_usage_and_exits_0(module, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before, by another
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert stop.value.code in (0, None), (module, stop.value.code, err.getvalue()[-2000:])
    assert out.getvalue().startswith("usage:"), (module, out.getvalue()[:300], err.getvalue()[-2000:])
