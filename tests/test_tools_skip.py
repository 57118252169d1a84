"""The sandbox tests skip wherever the executor would fall back: a bwrap that is installed but
cannot create namespaces (Docker's default seccomp profile) must not let their misdeeds (a fork
bomb, a write to /) run unsandboxed on the host."""

import importlib.util
import os

# What bwrap prints where the kernel or a seccomp profile refuses its namespaces.
REFUSING_BWRAP = "#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n"


def test_the_sandbox_tests_skip_where_bwrap_is_installed_but_cannot_sandbox(tmp_path, monkeypatch):
    bwrap = tmp_path / "bwrap"
    bwrap.write_text(REFUSING_BWRAP)
    bwrap.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    # the module's skip mark is decided at import: import a fresh copy under the refusing bwrap
    path = os.path.join(os.path.dirname(__file__), "test_tools_sandbox.py")
    spec = importlib.util.spec_from_file_location("sandbox_tests_under_a_refusing_bwrap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    mark = module.pytestmark
    assert mark.name == "skipif" and mark.args == (True,), mark
    assert mark.kwargs["reason"].startswith("bwrap cannot sandbox here (bwrap: No permissions to create new "
                                            "namespace): tool calls run WITHOUT network"), mark.kwargs
