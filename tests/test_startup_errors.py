"""A role that fails before its actor runs leaves an error file, and the caller's error names
the role, that file and the likely fix (not a cascade of unrelated tracebacks)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime import Supervisor, SupervisionFailed
from runtime.child import StartupError

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[1]

# The module imports in this (parent) process and fails in the role, as a module does when
# the role's environment lacks what the parent's has.
FAILING_MODULE = """
import os
from runtime import Actor, endpoint
if os.environ.get("FAIL_IMPORT_IN_ROLE"):
    import tandem_module_that_is_not_installed
class Scorer(Actor):
    @endpoint
    def ping(self):
        return 1
"""


def run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n" + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)


def test_import_error_in_the_role_class_module_writes_the_error_file_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "user_scorer.py").write_text(FAILING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_scorer

    run_dir = tmp_path / "run"
    sup = Supervisor(run_dir, heartbeat_interval=0.1)
    try:
        sup.spawn("reward", user_scorer.Scorer, env={"FAIL_IMPORT_IN_ROLE": "1"})
        with pytest.raises(SupervisionFailed) as info:
            sup.wait_ready(timeout=60)
    finally:
        sup.shutdown()
    message = str(info.value)
    error_file = run_dir / "errors" / "reward.0.txt"
    text = error_file.read_text()
    assert "failed while unpickling its class" in text
    assert "No module named 'tandem_module_that_is_not_installed'" in text
    assert "Likely fix: the module exists in the parent but not in this fresh interpreter" in text
    assert "'reward' died while starting" in message and str(error_file) in message
    assert "Likely fix" in message


def test_import_error_in_a_custom_reward_module_names_the_fix(tmp_path):
    from roles.reward.config import ScorerConfig
    from roles.reward.role import RewardScorer

    (tmp_path / "my_rm.py").write_text("import tandem_reward_dep_not_installed\ndef score(s):\n    return 1.0\n")
    run_dir = tmp_path / "run"
    sup = Supervisor(run_dir, heartbeat_interval=0.1)
    try:
        sup.spawn("reward-0", RewardScorer,
                  ScorerConfig(rm_type="math", custom_rm_path=f"{tmp_path}/my_rm.py:score", num_workers=1))
        with pytest.raises(SupervisionFailed, match="(?s)reward-0.*Likely fix: the module exists"):
            sup.wait_ready(timeout=60)
    finally:
        sup.shutdown()
    text = (run_dir / "errors" / "reward-0.0.txt").read_text()
    assert "failed while running RewardScorer.__init__" in text
    assert "tandem_reward_dep_not_installed" in text


def test_an_argument_that_cannot_be_sent_fails_the_spawn_naming_the_role(sup):
    import threading

    from tests.actors import Echo

    with pytest.raises(StartupError, match="role 'e': cannot send the arguments of Echo.*cannot send an object"):
        sup.spawn("e", Echo, threading.Lock())
    assert "e" not in sup._children  # nothing half-registered: shutdown stays clean
    assert sup.spawn("e", Echo, "ok").ping(1) == 1


def test_a_class_defined_in_a_function_fails_the_spawn_with_the_fix(sup):
    from runtime import Actor, endpoint

    class Local(Actor):
        @endpoint
        def ping(self):
            return 1

    with pytest.raises(StartupError, match="role 'local': cannot send its class.*top level of an importable module"):
        sup.spawn("local", Local)
    assert "local" not in sup._children


def test_a_script_without_a_main_guard_gets_the_guard_fix_not_a_cascade(tmp_path):
    result = run_script(tmp_path, """
        from runtime import Actor, Supervisor, endpoint
        class E(Actor):
            @endpoint
            def ping(self):
                return 1
        with Supervisor("run", heartbeat_interval=0.1) as sup:
            sup.spawn("echo", E).ping()
    """)
    assert result.returncode == 1
    error_file = tmp_path / "run" / "errors" / "echo.0.txt"
    text = error_file.read_text()
    assert 'Likely fix: put the code that starts the run under `if __name__ == "__main__":`' in text
    assert "user_script.py" in text
    # the parent's error names the role, the error file and the fix
    assert "actor 'echo' (incarnation 0) died" in result.stderr
    assert f"error file: {error_file}" in result.stderr
    assert "in use by the supervisor" not in result.stderr  # the old cascade: a second supervisor


def test_a_main_module_that_fails_on_reimport_gets_a_supervisor_written_diagnosis(tmp_path):
    result = run_script(tmp_path, """
        import os
        if os.environ.get("TANDEM_ERROR_FILE"):
            raise RuntimeError("top-level code that fails only in a role")
        from runtime import Supervisor
        from tests.actors import Echo
        if __name__ == "__main__":
            with Supervisor("run", heartbeat_interval=0.1) as sup:
                sup.spawn("echo", Echo)
                sup.wait_ready(timeout=60)
    """)
    assert result.returncode == 1
    text = (tmp_path / "run" / "errors" / "echo.0.txt").read_text()
    assert "before its actor code ran" in text and "written by the supervisor" in text
    assert "user_script.py is imported again in every role" in text
    assert "SupervisionFailed: actor 'echo' died while starting" in result.stderr
    assert "echo.0.txt" in result.stderr
