"""An example tool: a calculator for integer arithmetic, in miles' tool interface.

- ``TOOL_SPECS``: the OpenAI-style spec of the one tool, ``calculator(expression)``
  (``--generate-tool-specs-path roles.tools.calculator:TOOL_SPECS``);
- ``execute_tool(name, arguments) -> str``: miles' execute-tool function
  (``--generate-execute-tool-function-path roles.tools.calculator:execute_tool``);
- ``evaluate(expression) -> str``: the arithmetic itself.

The expression is read by a small parser of its own (integers, + - * / // % ** and
parentheses, with Python's precedence) and computed; nothing is ever handed to ``eval()``, and
nothing is imported: the sandbox starts a fresh Python for each call, and ``ast`` alone would
cost each call 15 ms. A wrong expression is an answer the model reads (``"error: ..."``), not
an exception: a calculator shows "Error" and goes on, and the sandbox's error kinds stay for
tools that break.
"""

MAX_EXPRESSION_CHARS = 200  # the parser recurses once per parenthesis: far below Python's recursion limit
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

_OPERATORS = ("**", "//", "+", "-", "*", "/", "%", "(", ")")  # two-character ones first


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
        return str(_Parser(expression).parse())
    except (ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


class _Parser:
    """Recursive descent over Python's grammar for these operators:
    sum := product (("+" | "-") product)*;  product := unary (("*" | "/" | "//" | "%") unary)*;
    unary := ("+" | "-") unary | power;  power := atom ("**" unary)?;  atom := INTEGER | "(" sum ")"."""

    def __init__(self, expression: str):
        self.text = expression
        self.tokens = _tokens(expression)
        self.i = 0

    def parse(self) -> int:
        if not self.tokens:
            raise ValueError("the expression is empty")
        value = self._sum()
        if self.i < len(self.tokens):
            raise ValueError(f"{self.text!r} is not an arithmetic expression (unexpected {self.tokens[self.i]!r})")
        return value

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError(f"{self.text!r} is not an arithmetic expression (it ends too early)")
        self.i += 1
        return token

    def _sum(self) -> int:
        value = self._product()
        while self._peek() in ("+", "-"):
            value = _checked(value + self._product() if self._take() == "+" else value - self._product())
        return value

    def _product(self) -> int:
        value = self._unary()
        while self._peek() in ("*", "/", "//", "%"):
            op, right = self._take(), self._unary()
            if op != "*" and right == 0:
                raise ZeroDivisionError("division by zero")
            if op == "/" and value % right:
                raise ValueError(f"{value} / {right} is not a whole number; use // for the quotient")
            value = _checked(value * right if op == "*" else value % right if op == "%" else value // right)
        return value

    def _unary(self) -> int:
        if self._peek() in ("+", "-"):
            return self._unary() if self._take() == "+" else -self._unary()
        return self._power()

    def _power(self) -> int:
        base = self._atom()
        if self._peek() != "**":
            return base
        self._take()
        exponent = self._unary()
        if not 0 <= exponent <= MAX_EXPONENT:
            raise ValueError(f"exponent {exponent} is outside 0..{MAX_EXPONENT}")
        return _checked(base**exponent)

    def _atom(self) -> int:
        token = self._take()
        if token == "(":
            value = self._sum()
            if self._peek() != ")":
                raise ValueError(f"{self.text!r} is not an arithmetic expression (a parenthesis is not closed)")
            self._take()
            return value
        if token.isdigit():
            return _checked(int(token))
        raise ValueError(f"{self.text!r} is not an arithmetic expression (unexpected {token!r})")


def _tokens(expression: str) -> list[str]:
    tokens, i = [], 0
    while i < len(expression):
        c = expression[i]
        if c.isspace():
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < len(expression) and "0" <= expression[j] <= "9":
                j += 1
            tokens.append(expression[i:j])
            i = j
        else:
            op = next((op for op in _OPERATORS if expression.startswith(op, i)), None)
            if op is None:
                raise ValueError(f"{c!r} is not integer arithmetic (numbers, + - * / // % ** and parentheses)")
            tokens.append(op)
            i += len(op)
    return tokens


def _checked(value: int) -> int:
    if abs(value) >= _LIMIT:
        raise ValueError(f"a number has more than {MAX_DIGITS} digits")
    return value
