"""Turn the small LaTeX of final answers into plain infix text that sympy can parse.

Covers what boxed answers actually contain (fractions, roots, pi, infinity, products,
text wrappers, spacing). Anything else stays as a backslash command, which the
equivalence guard then refuses to evaluate, so an unknown command never parses into
something wrong.
"""

import re

# Commands whose braced argument is kept and whose name is dropped.
_WRAPPERS = ("text", "textbf", "mathrm", "mathbf", "mathit", "operatorname", "mbox", "boxed")
_SYMBOLS = {
    "\\pi": " pi ",
    "\\infty": " oo ",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
}
_COMMAND = re.compile(r"\\([a-zA-Z]+)")
_SPACING = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\displaystyle")


def latex_to_plain(expr: str) -> str:
    """``"\\frac{x}{2}\\sqrt{3}"`` -> ``"(x)/(2)sqrt(3)"``; ``"\\frac{1}{2}"`` -> ``"1/2"``."""
    expr = expr.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for command in _SPACING:
        # "\right" must not eat the start of "\rightarrow".
        expr = re.sub(re.escape(command) + r"(?![a-zA-Z])", " ", expr)
    expr = _rewrite_commands(expr)
    for command, plain in _SYMBOLS.items():
        expr = re.sub(re.escape(command) + r"(?![a-zA-Z])", plain, expr)
    expr = re.sub(r"\^\{(\d)\}", r"^\1", expr)  # x^{2} -> x^2; longer exponents stay braced
    return expr.strip()


def _rewrite_commands(expr: str) -> str:
    """Rewrite ``\\frac``, ``\\sqrt`` and text wrappers, innermost arguments first."""
    out = []
    i = 0
    while i < len(expr):
        match = _COMMAND.match(expr, i)
        if not match:
            out.append(expr[i])
            i += 1
            continue
        name = match.group(1)
        after = match.end()
        if name == "frac":
            num, after_num = _argument(expr, after)
            den, after_den = _argument(expr, after_num) if num is not None else (None, after)
            if den is None:
                out.append(expr[i:after])
                i = after
                continue
            # A mixed number "3\frac{1}{2}" means 3 + 1/2 in LaTeX; the space lets the
            # mixed-number rule of the normaliser turn it into an addition.
            out.append(" " + _fraction(_rewrite_commands(num), _rewrite_commands(den)))
            i = after_den
        elif name == "sqrt" and not expr[after:].startswith("["):
            arg, after_arg = _argument(expr, after)
            if arg is None:
                out.append(expr[i:after])
                i = after
                continue
            out.append(f"sqrt({_rewrite_commands(arg)})")
            i = after_arg
        elif name in _WRAPPERS:
            arg, after_arg = _argument(expr, after)
            if arg is None:
                out.append(expr[i:after])
                i = after
                continue
            out.append(_rewrite_commands(arg))
            i = after_arg
        else:
            out.append(expr[i:after])
            i = after
    return "".join(out)


def _fraction(num: str, den: str) -> str:
    # Integer parts stay bare ("1/2") so that the grader can tell an unreduced fraction
    # ("2/4") from a reduced one, as the MATH grader does; anything else is parenthesised.
    if re.fullmatch(r"-?\d+", num.strip()) and re.fullmatch(r"\d+", den.strip()):
        return f"{num.strip()}/{den.strip()}"
    return f"({num})/({den})"


def _argument(expr: str, pos: int) -> tuple[str | None, int]:
    """One LaTeX argument at ``pos``: a brace group or a single character."""
    while pos < len(expr) and expr[pos] == " ":
        pos += 1
    if pos >= len(expr):
        return None, pos
    if expr[pos] != "{":
        if expr[pos] in "}\\":
            return None, pos
        return expr[pos], pos + 1
    depth = 0
    for j in range(pos, len(expr)):
        if expr[j] == "{":
            depth += 1
        elif expr[j] == "}":
            depth -= 1
            if depth == 0:
                return expr[pos + 1 : j], j + 1
    return None, pos
