"""An example tool: a calculator for integer arithmetic, in miles' tool interface.

- ``TOOL_SPECS``: the OpenAI-style spec of the one tool, ``calculator(expression)``
  (``--generate-tool-specs-path roles.tools.calculator:TOOL_SPECS``);
- ``execute_tool(name, arguments) -> str``: miles' execute-tool function
  (``--generate-execute-tool-function-path roles.tools.calculator:execute_tool``);
- ``evaluate(expression) -> str``: the arithmetic itself.

The expression is parsed with ``ast`` and only integer literals, + - * // % ** and
parentheses are computed; nothing is ever handed to ``eval()``. A wrong expression is an
answer the model reads (``"error: ..."``), not an exception: a calculator shows "Error"
and goes on, and the sandbox's error kinds stay for tools that break.
"""

import ast
import operator

MAX_EXPRESSION_CHARS = 200  # ast.parse of a long or deeply nested text costs memory and recursion
MAX_EXPONENT = 64
MAX_DIGITS = 100  # no operand or result beyond this: a tower of powers would eat the CPU limit
_LIMIT = 10**MAX_DIGITS

TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate integer arithmetic: + - * / // % ** and parentheses, e.g. 12*(3+4).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "the arithmetic to evaluate"}},
                "required": ["expression"],
            },
        },
    }
]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.Div: None,  # exact division only (integer arithmetic): see _divide
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def execute_tool(name: str, arguments: dict) -> str:
    """miles' execute-tool function: one call of the tool ``name`` with its JSON arguments."""
    if name != "calculator":
        return f"error: no tool named {name!r}; the tool is 'calculator'"
    return evaluate(arguments["expression"])


def evaluate(expression: str) -> str:
    """The value of an integer expression as text (``"12*(3+4)"`` -> ``"84"``), or ``"error: ..."``."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return f"error: the expression has {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"error: {expression!r} is not an arithmetic expression"
    try:
        return str(_value(tree.body))
    except (ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def _value(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div):
            return _checked(_divide(left, right))
        if isinstance(node.op, ast.Pow) and not 0 <= right <= MAX_EXPONENT:
            raise ValueError(f"exponent {right} is outside 0..{MAX_EXPONENT}")
        return _checked(_BINARY[type(node.op)](left, right))
    raise ValueError(f"{ast.unparse(node)!r} is not integer arithmetic (numbers, + - * / // % ** and parentheses)")


def _divide(left: int, right: int) -> int:
    if right == 0:
        raise ZeroDivisionError("division by zero")
    if left % right:
        raise ValueError(f"{left} / {right} is not a whole number; use // for the quotient")
    return left // right


def _checked(value: int) -> int:
    if abs(value) >= _LIMIT:
        raise ValueError(f"a number has more than {MAX_DIGITS} digits")
    return value
