"""Loading and checking the tools of a run (--generate-tool-specs-path, --generate-execute-tool-
function-path, as miles names them), the checks of a call's arguments, the calculator tool, which
executor a run's tools get, and what a machine without bwrap is told."""

import asyncio
import json
import random
import shutil

import pytest

from ppo.config import PPOConfig, override
from ppo.generate.tools import load_tool_setup, tool_limits
from roles.tools.executor import ToolExecutor
from roles.tools.in_process import InProcessExecutor
from roles.tools import calculator, sandbox
from roles.tools.calculator import TOOL_SPECS, evaluate
from roles.tools.specs import ToolSet, load_tools
from tests.test_bad_input import launch

GOOD_FUNCTION = "roles.tools.calculator:execute_tool"


def spec(name="calculator", **parameters):
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", **parameters}}}


def test_specs_load_from_a_json_file_or_a_python_list_as_in_miles(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOL_SPECS))
    from_file = load_tools(str(path), GOOD_FUNCTION)
    from_module = load_tools("roles.tools.calculator.TOOL_SPECS", "roles.tools.calculator.execute_tool")
    assert from_file.specs == from_module.specs == tuple(TOOL_SPECS)
    assert from_file.names == ("calculator",)


@pytest.mark.parametrize("content, problem", [
    (None, "cannot be read"),
    ("[{", "not JSON"),
    (json.dumps({"name": "calculator"}), "expected a non-empty list of tool specs, got dict"),
    (json.dumps([]), "expected a non-empty list"),
    (json.dumps([{"name": "calculator"}]), 'tool 0: expected {"type": "function"'),
    (json.dumps([spec(name="")]), "tool 0: the function has no name"),
    (json.dumps([spec(), spec()]), "names calculator more than once"),
    (json.dumps([spec(required="expression")]), "calculator: parameters.required must be a list of names"),
    (json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]),
     "f: parameters must be a JSON schema of type object"),
])
def test_a_bad_spec_file_is_one_line_naming_the_flag(tmp_path, content, problem):
    path = tmp_path / "tools.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_tools(str(path), GOOD_FUNCTION)
    assert str(err.value).startswith(f"--generate-tool-specs-path {path}: ") and problem in str(err.value)
    assert "\n" not in str(err.value)


def test_a_tool_function_that_does_not_load_or_takes_other_arguments_is_one_line(tmp_path):
    module = tmp_path / "tools.py"
    module.write_text("def one(name):\n    return name\n"
                      "async def fine(name, arguments):\n    return name\n"
                      "def also_fine(name, arguments, extra=None):\n    return name\n"
                      "NOT_A_FUNCTION = 3\n")
    broken = tmp_path / "broken.py"
    broken.write_text("def execute(name, arguments)\n")  # a syntax error
    for path, problem in ((f"{module}:one", "one(name) cannot be called with (name, arguments)"),
                          (f"{module}:missing", "has no attribute 'missing'"),
                          (f"{module}:NOT_A_FUNCTION", "'NOT_A_FUNCTION' is a int, not a function"),
                          (f"{tmp_path}/none.py:execute", "no such file"),
                          ("no_such_package.tools:execute", "cannot import 'no_such_package.tools'"),
                          (f"{broken}:execute", "importing it failed: SyntaxError")):
        with pytest.raises(ValueError) as err:
            load_tools("roles.tools.calculator:TOOL_SPECS", path)
        assert str(err.value).startswith("--generate-execute-tool-function-path") and problem in str(err.value), path
        assert "\n" not in str(err.value)
    for good in ("fine", "also_fine"):
        assert load_tools("roles.tools.calculator:TOOL_SPECS", f"{module}:{good}").function_path == f"{module}:{good}"


def test_a_call_is_checked_against_its_spec_before_it_runs():
    tools = load_tools("roles.tools.calculator:TOOL_SPECS", GOOD_FUNCTION)
    assert tools.argument_problem("calculator", {"expression": "1+1"}) is None
    assert tools.argument_problem("calc", {}) == ("unknown_tool", "no tool named 'calc'; the tools are: calculator")
    for arguments, problem in (({}, "calculator needs the argument expression"),
                               ({"expression": 12}, "argument expression of calculator must be a string, got int"),
                               ("1+1", "the arguments of calculator must be a JSON object, got str"),
                               ({"expression": "1", "x": object()}, "are not JSON")):
        kind, text = tools.argument_problem("calculator", arguments)
        assert kind == "bad_arguments" and problem in text, arguments
    typed = ToolSet(specs=(spec(properties={"n": {"type": "integer"}}),), function_path="")
    assert typed.argument_problem("calculator", {"n": True})[0] == "bad_arguments"  # a bool is no integer
    assert typed.argument_problem("calculator", {"n": 3}) is None


@pytest.mark.timeout(60)
def test_the_run_s_tools_run_in_the_sandbox_by_default_and_in_process_when_asked():
    both = override(PPOConfig(), generate_tool_specs_path="roles.tools.calculator:TOOL_SPECS",
                    generate_execute_tool_function_path=GOOD_FUNCTION)
    assert load_tool_setup(PPOConfig()) is None
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        load_tool_setup(override(both, generate_execute_tool_function_path="roles.tools.calculator:nope"))
    limits = tool_limits(both)
    assert (limits.memory_bytes, limits.max_file_bytes) == (1024 << 20, 64 << 20)
    for cfg, kind in ((both, ToolExecutor), (override(both, tool_sandbox=False), InProcessExecutor)):
        setup = load_tool_setup(cfg)
        try:
            assert type(setup.executor) is kind
            assert asyncio.run(setup.executor.call("calculator", {"expression": "6*7"})).text == "42"
        finally:
            setup.close()


@pytest.mark.slow  # the launcher imports torch and the roles (~7 s of CPU) before its pre-run checks
@pytest.mark.timeout(240)
def test_a_bad_tool_function_stops_the_launcher_with_one_line_and_exit_2_before_any_role(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(["--generate-tool-specs-path", "roles.tools.calculator:TOOL_SPECS",
                   "--generate-execute-tool-function-path", "roles.tools.calculator:evaluate",
                   "--run-dir", str(run_dir)], tmp_path, timeout=210)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tandem: ") and "roles.tools.calculator:evaluate" in last, last
    assert not run_dir.exists()


@pytest.mark.parametrize("expression, value", [
    ("12*(3+4)", "84"), ("-3 + -4", "-7"), ("17 // 5", "3"), ("17 % 5", "2"), ("8/2", "4"), ("2**64", str(2**64)),
    ("123456789123 + 876543210877", "1000000000000"), ("-2**2", "-4"), ("2**3**2", "512"), ("2*3+4*5", "26"),
    ("(1+2)*(3-10)//2", "-11"), ("-7 % 3", "2"), ("10-2-3", "5"), ("100//7//2", "7"), (" 42 ", "42"),
])
def test_the_calculator_does_integer_arithmetic(expression, value):
    assert evaluate(expression) == value
    assert calculator.execute_tool("calculator", {"expression": expression}) == value


@pytest.mark.parametrize("expression, error", [
    ("7/2", "7 / 2 is not a whole number"), ("1/0", "division by zero"), ("1 % 0", "division by zero"),
    ("2**65", "exponent 65 is outside 0..64"), ("9" * 101, "more than 100 digits"), ("1" * 201, "201 characters"),
    ("__import__('os').system('true')", "is not integer arithmetic"), ("(1).real", "is not integer arithmetic"),
    ("3.5 + 1", "'.' is not integer arithmetic"), ("1 +", "is not an arithmetic expression (it ends too early)"),
    ("(1 + 2", "a parenthesis is not closed"), ("1 2", "unexpected '2'"), ("", "the expression is empty"),
])
def test_the_calculator_answers_mistakes_in_words_and_never_runs_python(expression, error):
    answer = evaluate(expression)
    assert answer.startswith("error: ") and error in answer, answer


def test_the_calculator_agrees_with_python_on_random_expressions():
    """Python's own arithmetic is the reference (the tool never calls eval; this test does)."""
    rng = random.Random(0)

    def expression(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.randint(0, 50))
        op = rng.choice(["+", "-", "*", "//", "%", "**"])
        if op == "**":  # a small exponent: Python would compute a**b**c**d to the end
            return f"({expression(depth - 1)})**{rng.randint(0, 3)}"
        left, right = expression(depth - 1), expression(depth - 1)
        return rng.choice([f"{left}{op}{right}", f"({left}) {op} ({right})", f"-{left}{op}{right}"])

    for _ in range(500):
        e = expression(4)
        try:
            want = str(eval(e))
        except ZeroDivisionError:
            want = "error: division by zero"
        if len(want) > calculator.MAX_DIGITS:
            want = f"error: a number has more than {calculator.MAX_DIGITS} digits"
        assert evaluate(e) == want, e


def test_without_bwrap_the_sandbox_says_so_in_one_line(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    path, warning = sandbox.choose_bwrap()
    assert path is None and "\n" not in warning
    assert warning.startswith("bwrap (bubblewrap) is not installed: tool calls run WITHOUT network, PID and file-system "
                              "isolation") and "apt-get install bubblewrap" in warning


@pytest.mark.timeout(60)
def test_without_bwrap_the_executor_warns_once_and_runs_calls_with_the_limits_alone(monkeypatch, capsys):
    from roles.tools import executor as tool_executor
    from roles.tools.sandbox import Limits

    monkeypatch.setattr(shutil, "which", lambda name: None)
    tools = load_tools("roles.tools.calculator:TOOL_SPECS", GOOD_FUNCTION)
    limits = Limits(timeout_s=5.0, cpu_seconds=2, memory_bytes=512 << 20, max_processes=64, max_file_bytes=1 << 20,
                    max_output_chars=5)
    ex = tool_executor.ToolExecutor(tools, limits, num_workers=1)
    try:
        assert not ex.sandboxed
        assert capsys.readouterr().err == f"tandem: warning: {ex.warning}\n"
        assert asyncio.run(ex.call("calculator", {"expression": "6*7"})).text == "42"
        cut = asyncio.run(ex.call("calculator", {"expression": "10**9"}))
        assert (cut.ok, cut.error_kind, cut.text.splitlines()[0]) == (False, "output_limit", "10000")
    finally:
        ex.close()
