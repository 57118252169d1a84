"""What the sandbox binds back under its hidden directories (roles/tools/sandbox.py _bind_back,
_tool_paths): the import paths and the tool's code, never a home itself, which ``python -m``
run from a home puts on sys.path (its ~/.ssh, ~/.netrc and tokens would be readable)."""

from roles.tools import sandbox


def bound(flags: list[str]) -> list[str]:
    return [flags[i + 1] for i, flag in enumerate(flags) if flag == "--ro-bind"]


def test_a_home_on_sys_path_is_not_bound_back_but_what_lies_in_it_is():
    paths = sorted(["/home/alice", "/home/alice/tandem", "/home/alice/.venv/lib/python3.12/site-packages",
                    "/home", "/root", "/usr/lib/python3.12"])
    assert bound(sandbox._bind_back(paths)) == ["/home/alice/.venv/lib/python3.12/site-packages",
                                                "/home/alice/tandem"]


def test_the_tool_code_named_by_module_is_found_without_binding_its_folder(tmp_path):
    (tmp_path / "mytools.py").write_text("def execute(name, arguments):\n    return ''\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "calls.py").write_text("def execute(name, arguments):\n    return ''\n")
    sys_path = [str(tmp_path)]
    assert sandbox._tool_paths("mytools:execute", sys_path) == (str(tmp_path / "mytools.py"),)
    assert sandbox._tool_paths("pkg.calls:execute", sys_path) == (str(tmp_path / "pkg"),)
    assert sandbox._tool_paths(f"{tmp_path}/mytools.py:execute", []) == (str(tmp_path / "mytools.py"),)
    assert sandbox._tool_paths("no_such_module:execute", sys_path) == ()
