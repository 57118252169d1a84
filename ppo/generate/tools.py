"""The tools of the built-in tool loop: their specs, the function that runs a call, and the
executor the loop awaits.

    --generate-tool-specs-path            a list of OpenAI-style specs ({"type": "function",
                                          "function": {"name", "description", "parameters"}}),
                                          or a function returning one
    --generate-execute-tool-function-path async def execute(name: str, arguments: dict) -> str

Both are checked when the job starts (`load_tool_setup`, `check_chat_template`): a path that
does not load, specs of the wrong shape, a function of the wrong signature or a chat template
that cannot render a tool turn stop the run in one line (exit 2) before any role starts.

The executor contract, shared with the sandboxed workers of roles/tools/:
`await executor.call(name, arguments) -> ToolResult`. `InProcessExecutor` runs the function on
the driver's event loop, with a wall-clock timeout and an output limit but no isolation: it is
for tools that are plain, trusted Python (a calculator); anything else belongs in the sandbox.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass

from roles.reward.custom import load_object

TOOL_TIMEOUT_S = 30.0  # wall clock of one in-process call
MAX_OUTPUT_CHARS = 4096  # longer tool output is cut (and says so): it is the model's context


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads
    ok: bool
    error_kind: str | None  # None, "error" (raised, bad output) or "timeout"
    seconds: float


class InProcessExecutor:
    def __init__(self, execute: Callable, timeout_s: float = TOOL_TIMEOUT_S, max_chars: int = MAX_OUTPUT_CHARS):
        self._execute, self.timeout_s, self.max_chars = execute, timeout_s, max_chars

    async def call(self, name: str, arguments: dict) -> ToolResult:
        t0 = time.perf_counter()
        try:
            text = await asyncio.wait_for(self._execute(name, arguments), self.timeout_s)
        except TimeoutError:
            return ToolResult(f"error: {name} took longer than {self.timeout_s:g} s", False, "timeout",
                              time.perf_counter() - t0)
        except Exception as e:  # the tool's own failure is the model's to read, never the run's
            return ToolResult(f"error: {name} raised {type(e).__name__}: {e}", False, "error",
                              time.perf_counter() - t0)
        seconds = time.perf_counter() - t0
        if not isinstance(text, str):
            return ToolResult(f"error: {name} returned {type(text).__name__}, not text", False, "error", seconds)
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"... (cut at {self.max_chars} characters)"
        return ToolResult(text, True, None, seconds)


@dataclass(frozen=True)
class ToolSetup:
    specs: list[dict]  # as the chat template takes them (tools=...)
    executor: object  # .call(name, arguments) -> ToolResult
    max_turns: int
    parser: str

    @property
    def names(self) -> frozenset[str]:
        return frozenset(_name(s) for s in self.specs)


def load_tool_setup(g) -> ToolSetup | None:
    """The tool setup of a GenerateConfig `g`, or None without tools; ValueError (one line) when
    a path does not load or names the wrong thing."""
    if g.generate_tool_specs_path is None:
        return None
    specs = _load(g.generate_tool_specs_path, "generate_tool_specs_path")
    if callable(specs):
        specs = specs()
    problem = _specs_problem(specs)
    if problem:
        raise ValueError(f"generate_tool_specs_path={g.generate_tool_specs_path!r}: {problem}")
    executor = None
    if g.generate_execute_tool_function_path is not None:
        path = g.generate_execute_tool_function_path
        execute = _load(path, "generate_execute_tool_function_path")
        if not inspect.iscoroutinefunction(execute):
            raise ValueError(f"generate_execute_tool_function_path={path!r}: must be an async def "
                             "execute(name, arguments) -> str")
        try:
            inspect.signature(execute).bind("name", {})
        except TypeError:
            raise ValueError(f"generate_execute_tool_function_path={path!r}: {execute.__name__}"
                             f"{inspect.signature(execute)} must take (name, arguments)") from None
        executor = InProcessExecutor(execute)
    return ToolSetup(specs=list(specs), executor=executor, max_turns=g.generate_max_turns,
                     parser=g.generate_tool_call_parser)


def check_chat_template(tokenizer, setup: ToolSetup) -> None:
    """ValueError unless the tokenizer's chat template renders a tool turn after an assistant
    turn ending in its eos token, token for token (ppo.generate.chat.tool_turn_ids)."""
    from ppo.generate.chat import ToolCallError, tool_messages, tool_turn_ids

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tool loop renders tool results with the tokenizer's chat template, and "
                         "this tokenizer has none")
    calls = [ToolCallError("error: check")]
    try:
        tool_turn_ids(tokenizer, tool_messages(calls, ["ok"]), calls, tokenizer.eos_token_id, setup.specs)
    except Exception as e:  # jinja errors too: the template is the user's
        raise ValueError(f"the tokenizer's chat template cannot render a tool turn: {e}") from None


def _load(path: str, setting: str):
    try:
        return load_object(path, setting)
    except ValueError:
        raise
    except Exception as e:  # the user's module fails on import: a SyntaxError, a missing package
        raise ValueError(f"{setting}={path!r}: importing it raised {type(e).__name__}: {e}") from None


def _name(spec: dict):
    return spec["function"]["name"] if "function" in spec else spec.get("name")


def _specs_problem(specs) -> str | None:
    if not isinstance(specs, (list, tuple)) or not specs:
        return f"must name a non-empty list of tool specs, got {type(specs).__name__}"
    names = []
    for i, spec in enumerate(specs):
        inner = spec.get("function", spec) if isinstance(spec, dict) else None
        if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
            return (f"spec #{i} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, "
                    f"got {spec!r}")
        names.append(inner["name"])
    if len(set(names)) != len(names):
        return f"tool names must be unique, got {names}"
    return None
