"""String normalisation of LaTeX answers as in the MATH benchmark (Hendrycks et al.).

Two answers are equal under this rule when their normal forms are identical strings;
no algebra happens here (that is ``equivalence.py``). The steps follow the MATH
grader that deepscaler reuses, so a reward here means what it means in miles/slime.
"""

import re

_ENCLOSING_TEXT = re.compile(r"^\\text\{(?P<inner>.+?)\}$")
_SIMPLE_FRACTION = re.compile(r"^(-?\d+)/(\d+)$")


def normalize_mathd(answer: str) -> str:
    """Canonical string form of a LaTeX answer: ``"\\dfrac12"`` and ``"0.5"`` both give ``"\\frac{1}{2}"``."""
    answer = answer.strip()
    inner = _ENCLOSING_TEXT.match(answer)
    if inner:
        answer = inner.group("inner").strip()
    answer = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    answer = answer.replace("tfrac", "frac").replace("dfrac", "frac")
    answer = answer.replace("\\left", "").replace("\\right", "")
    answer = answer.replace("^{\\circ}", "").replace("^\\circ", "")
    answer = answer.replace("\\$", "")
    answer = _drop_units(answer)
    answer = answer.replace("\\%", "")
    answer = answer.replace(" .", " 0.").replace("{.", "{0.")
    if answer.startswith("."):
        answer = "0" + answer
    answer = _drop_short_assignment(answer)
    answer = _brace_sqrt_argument(answer)
    answer = answer.replace(" ", "")
    answer = _brace_frac_arguments(answer)
    if answer == "0.5":
        answer = "\\frac{1}{2}"
    return _slash_to_frac(answer)


def _drop_units(answer: str) -> str:
    # In MATH, "\text{ " (with the space) only ever introduces a unit on the right.
    head, sep, _ = answer.partition("\\text{ ")
    return head if sep else answer


def _drop_short_assignment(answer: str) -> str:
    # "x = 5" or "k=5": the left side is a variable name, the answer is the right side.
    parts = answer.split("=")
    if len(parts) == 2 and len(parts[0]) <= 2:
        return parts[1]
    return answer


def _brace_sqrt_argument(answer: str) -> str:
    # "\sqrt3" -> "\sqrt{3}": one character is the argument when no brace follows.
    return re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", answer)


def _brace_frac_arguments(answer: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``."""
    pieces = answer.split("\\frac")
    out = pieces[0]
    for piece in pieces[1:]:
        out += "\\frac"
        if piece.startswith("{"):
            out += piece
        elif len(piece) < 2:
            return answer  # "\frac" with fewer than two arguments: leave the answer alone
        elif piece[1] == "{":
            out += "{" + piece[0] + "}" + piece[1:]
        else:
            out += "{" + piece[0] + "}{" + piece[1] + "}" + piece[2:]
    return out


def _slash_to_frac(answer: str) -> str:
    # Only a plain "a/b" of integers becomes \frac{a}{b}: "1/2" matches a "\frac{1}{2}" label.
    match = _SIMPLE_FRACTION.match(answer)
    if not match:
        return answer
    return "\\frac{" + match.group(1) + "}{" + match.group(2) + "}"
