"""The tools of a run: their OpenAI-style specs and the function that executes them, as miles
names them (``--generate-tool-specs-path``, ``--generate-execute-tool-function-path``).

- Specs: a JSON file (``tools.json``) holding a list of ``{"type": "function", "function":
  {"name", "description", "parameters"}}``, or, as in miles, a Python list named by import path
  (``package.module:TOOLS`` or ``package.module.TOOLS``), or a function returning one.
- The function: ``execute(name: str, arguments: dict) -> str``, sync or ``async def`` (miles'
  ``execute_tool_call(name, params)``, awaited once per call and required to return a str),
  named as ``--custom-rm-path`` names one. It runs in the sandbox (``--tool-sandbox``, the
  default), or in the rollout's process (``--no-tool-sandbox``: roles.tools.in_process).

``load_tools`` checks both in the launching process and raises ValueError with one line;
``ToolSet.argument_problem`` checks a call's arguments against its spec before any sandbox starts.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from roles.reward.custom import describe, load_object, load_function

SPECS_FLAG = "--generate-tool-specs-path"
FUNCTION_FLAG = "--generate-execute-tool-function-path"
_FUNCTION_CONTRACT = "a tool function takes (name: str, arguments: dict) and returns a str, as miles' execute_tool_call"
# JSON-schema type -> the Python types json.loads gives for it (bool is an int in Python: excluded below)
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "object": (dict,), "array": (list,), "null": (type(None),)}


@dataclass(frozen=True)
class ToolSet:
    specs: tuple[dict, ...]  # as loaded, for the chat template's `tools=`
    function_path: str | None  # loaded again inside each sandbox; None: specs alone, for a custom generate function

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec["function"]["name"] for spec in self.specs)

    def argument_problem(self, name: str, arguments: object) -> tuple[str, str] | None:
        """``(error_kind, message for the model)`` when the call cannot run, else None: an unknown
        tool, arguments that are not a JSON object, a required one missing, one of the wrong type."""
        spec = next((s["function"] for s in self.specs if s["function"]["name"] == name), None)
        if spec is None:
            return "unknown_tool", f"no tool named {name!r}; the tools are: {', '.join(self.names)}"
        if not isinstance(arguments, dict):
            return "bad_arguments", f"the arguments of {name} must be a JSON object, got {type(arguments).__name__}"
        try:
            json.dumps(arguments)
        except (TypeError, ValueError) as e:
            return "bad_arguments", f"the arguments of {name} are not JSON: {e}"
        parameters = spec.get("parameters") or {}
        missing = [p for p in parameters.get("required", ()) if p not in arguments]
        if missing:
            return "bad_arguments", f"{name} needs the argument{'s' * (len(missing) > 1)} {', '.join(missing)}"
        for key, value in arguments.items():
            kind = (parameters.get("properties") or {}).get(key, {}).get("type")
            if kind in _JSON_TYPES and not _is_json_type(value, kind):
                return "bad_arguments", f"argument {key} of {name} must be a {kind}, got {type(value).__name__}"
        return None


def load_tools(specs_path: str, function_path: str) -> ToolSet:
    """The checked specs and function path; ValueError of one line naming the flag otherwise."""
    specs = load_specs(specs_path)
    load_tool_function(function_path)
    return ToolSet(specs=specs, function_path=function_path)


def load_tool_function(function_path: str) -> Callable:
    """The function ``function_path`` names, checked; ValueError of one line naming the flag otherwise."""
    function = _load(function_path, FUNCTION_FLAG)
    check_tool_function(function, function_path)
    return function


def check_tool_function(function: Callable, function_path: str) -> None:
    """ValueError unless ``function(name, arguments)`` can be called (sync or async)."""
    try:
        inspect.signature(function).bind("calculator", {})
    except TypeError:
        raise ValueError(f"{FUNCTION_FLAG} {function_path}: {function.__name__}{inspect.signature(function)} cannot "
                         f"be called with (name, arguments); {_FUNCTION_CONTRACT}") from None
    except ValueError:  # a builtin without a signature: it will say so when called
        pass


def _load(path: str, flag: str, loader=load_function):
    """``loader(path, flag)``, with what the user's module raises on import turned into one line too."""
    try:
        return loader(path, flag)
    except ValueError:
        raise
    except Exception as e:  # SyntaxError, an ImportError inside the module, anything it raises
        raise ValueError(f"{flag} {path}: importing it failed: {describe(e)}") from None


def load_specs(path: str) -> tuple[dict, ...]:
    where = f"{SPECS_FLAG} {path}"
    if path.endswith(".json"):
        try:
            specs = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"{where}: cannot be read ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
    else:
        specs = _load(path, SPECS_FLAG, load_object)  # miles: the import path of a Python list
        if callable(specs):  # or of a function returning one
            try:
                specs = specs()
            except Exception as e:
                raise ValueError(f"{where}: calling it failed: {describe(e)}") from None
    if not isinstance(specs, (list, tuple)) or not specs:
        raise ValueError(f"{where}: expected a non-empty list of tool specs, got {type(specs).__name__}")
    names = []
    for i, spec in enumerate(specs):
        if problem := _spec_problem(spec):
            raise ValueError(f"{where}: tool {i}: {problem}")
        names.append(spec["function"]["name"])
    if dup := sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{where}: names {', '.join(dup)} more than once; each tool needs a name of its own")
    return tuple(specs)


def _spec_problem(spec: object) -> str | None:
    shape = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
    if not isinstance(spec, Mapping) or spec.get("type") != "function" or not isinstance(spec.get("function"), Mapping):
        return f"expected {shape}"
    function = spec["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        return f"the function has no name; expected {shape}"
    parameters = function.get("parameters", {})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        return f"{function['name']}: parameters must be a JSON schema of type object"
    if not isinstance(parameters.get("properties", {}), Mapping):
        return f"{function['name']}: parameters.properties must be an object"
    required = parameters.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return f"{function['name']}: parameters.required must be a list of names"
    return None


def _is_json_type(value: object, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _JSON_TYPES[kind])
