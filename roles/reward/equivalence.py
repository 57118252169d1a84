"""Is a model's final answer equal to the label? String forms first, then sympy.

``answers_match`` is the grader behind the ``deepscaler`` and ``math`` rules. It accepts
an answer when any of these holds, cheapest first:

1. the MATH-style normal forms are the same string (``mathd.normalize_mathd``);
2. sympy says ``label - answer`` simplifies to 0, after a second normalisation
   (units, thousands separators, LaTeX -> plain) and a guard that refuses expressions
   sympy could spend minutes on (towers of powers, long inputs, many unknowns);
3. ``math_verify`` agrees, when that package is installed (it is optional).

As in the MATH/deepscaler grader, an integer label needs an integer answer and two plain
fractions must be written the same way (``2/4`` is not accepted for ``1/2``).
"""

import re

import sympy
from sympy.parsing import sympy_parser

from roles.reward.latex import latex_to_plain
from roles.reward.mathd import normalize_mathd

try:
    import math_verify
except ImportError:  # optional: more lenient matching when present; not a Tandem dependency
    math_verify = None

_UNIT_WORDS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day",
    "week", "month", "year", "foot", "feet", "inch", "yard",
)  # fmt: skip
_UNIT_PATTERN = re.compile("(?:" + "|".join(_UNIT_WORDS) + r")(?:es)?s? *(?:\^[0-9]+)?")
_SCALE_WORDS = {"million": "*10^6", "billion": "*10^9", "trillion": "*10^12"}
_THOUSANDS_COMMA = re.compile(r"(\d),(\d\d\d)($|\D)")
_PLAIN_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_TUPLE_CHARS = "()[]"

# Guard before sympy. Exponents are where sympy (and bignum arithmetic under it) can run
# for minutes or exhaust memory: refuse braced/parenthesised exponents, chained powers
# and exponents of two or more digits. Only this character set reaches sympy's parser,
# which is built on eval(): no quotes, underscores, brackets of other kinds or "!".
_MAX_SYMPY_CHARS = 256
_SAFE_CHARS = re.compile(r"^[0-9a-z+\-*/^().,\s]*$")
_UNSAFE_SUBSTRINGS = ("^{", "^(", "**")
_UNSAFE_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_MAX_UNKNOWN_LETTERS = 2

_SYMPY_NAMES = {
    "__builtins__": {},
    "Integer": sympy.Integer,
    "Float": sympy.Float,
    "Rational": sympy.Rational,
    "Symbol": sympy.Symbol,
    "sqrt": sympy.sqrt,
    "pi": sympy.pi,
    "oo": sympy.oo,
}
_TRANSFORMATIONS = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)


def answers_match(given: str, truth: str) -> bool:
    """True when ``given`` (a model's boxed answer) equals ``truth`` (the label)."""
    if normalize_mathd(given) == normalize_mathd(truth):
        return True
    if _sympy_grade(given, truth):
        return True
    return _math_verify_grade(given, truth)


def normalize_for_sympy(expr: str) -> str:
    """Plain, lower-case, unit-free text: ``"\\$1,000"`` -> ``"1000"``, ``"\\frac{1}{2}"`` -> ``"1/2"``."""
    inner = re.match(r"^\\text\{(?P<inner>.+?)\}$", expr)
    if inner:
        expr = inner.group("inner")
    expr = expr.replace("\\%", "").replace("\\$", "").replace("$", "").replace("%", "")
    expr = expr.replace(" or ", " , ").replace(" and ", " , ")
    for word, scale in _SCALE_WORDS.items():
        expr = expr.replace(word, scale)
    expr = _UNIT_PATTERN.sub("", expr)
    expr = re.sub(r"\^ *\{?\\circ\}?", "", expr)
    expr = expr.strip()
    if expr.endswith(".") and not expr.endswith(".."):
        expr = expr[:-1]  # a sentence-final period: "5." is the answer 5
    if expr.startswith("{") and expr.endswith("}"):
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    if _as_integer(expr) is not None:
        expr = _as_integer(expr)
    if "\\" in expr:
        expr = latex_to_plain(expr)
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # mixed number: "7 3/4" is 7 + 3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    integer = _as_integer(_strip_thousands_commas(expr))
    return integer if integer is not None else expr


def _sympy_grade(given: str, truth: str) -> bool:
    truth_norm = normalize_for_sympy(truth)
    given_norm = normalize_for_sympy(given)
    if truth_norm == given_norm:
        return True
    if not given_norm:
        return False
    truth_elems = _split_tuple(truth_norm)
    given_elems = _split_tuple(given_norm)
    # For tuples and intervals the bracket kinds must agree: (1,2] is not [1,2].
    if len(truth_elems) > 1 and (truth_norm[0] != given_norm[0] or truth_norm[-1] != given_norm[-1]):
        return False
    if len(truth_elems) != len(given_elems):
        return False
    return all(_elements_match(t, g) for t, g in zip(truth_elems, given_elems, strict=True))


def _elements_match(truth: str, given: str) -> bool:
    if _PLAIN_FRACTION.match(truth) and _PLAIN_FRACTION.match(given):
        return truth == given  # an unreduced fraction is a wrong answer: no simplification
    if (_as_integer(_strip_thousands_commas(truth)) is None) != (_as_integer(_strip_thousands_commas(given)) is None):
        return False  # an integer label needs an integer answer, not 4.0000001
    return sympy_equal(truth, given)


def sympy_equal(a: str, b: str) -> bool:
    """True when plain-text expressions ``a`` and ``b`` differ by 0 under ``sympy.simplify``.

    False for anything the guard refuses or sympy cannot parse. The guard bounds the
    common slow inputs, not all of them: callers still run this under a timeout.
    """
    expr = f"({a})-({b})"
    if not _safe_for_sympy(expr):
        return False
    try:
        diff = sympy_parser.parse_expr(
            expr.replace("^", "**"), global_dict=dict(_SYMPY_NAMES), transformations=_TRANSFORMATIONS
        )
        return sympy.simplify(diff) == 0
    except Exception:  # unparsable or ill-typed text is simply not an equal answer
        return False


def _safe_for_sympy(expr: str) -> bool:
    if len(expr) > _MAX_SYMPY_CHARS or not _SAFE_CHARS.match(expr):
        return False
    if any(s in expr for s in _UNSAFE_SUBSTRINGS) or any(p.search(expr) for p in _UNSAFE_PATTERNS):
        return False
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    return len(letters) <= _MAX_UNKNOWN_LETTERS


def _math_verify_grade(given: str, truth: str) -> bool:
    if math_verify is None:
        return False
    try:
        return bool(math_verify.verify(math_verify.parse(f"${truth}$"), math_verify.parse(f"${given}$")))
    except Exception:  # math_verify raises on text it cannot parse: that is no match
        return False


def _as_integer(expr: str) -> str | None:
    """``"12"``/``"12.0"`` -> ``"12"``; None when ``expr`` is not an integer-valued number."""
    try:
        value = float(expr)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):
        return None
    rounded = round(value)
    if abs(value - rounded) > 1e-7:
        return None
    if re.fullmatch(r"[+-]?\d+", expr.strip()):
        return str(int(expr))  # exact: a float would lose digits past 2**53
    return str(rounded)


def _split_tuple(expr: str) -> list[str]:
    """``"(1,2]"`` -> ``["1", "2"]``; anything that is not one flat tuple/interval -> ``[expr]``."""
    expr = _strip_thousands_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    bracketed = len(expr) > 2 and expr[0] in _TUPLE_CHARS and expr[-1] in _TUPLE_CHARS
    if bracketed and not any(c in inner for c in _TUPLE_CHARS):
        return [elem.strip() for elem in inner.split(",")]
    return [expr]


def _strip_thousands_commas(expr: str) -> str:
    # Only well-formed groups ("1,000,000") lose their commas; "(1,2)" is a tuple.
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\2\3", expr)
        if stripped == expr:
            return stripped
        expr = stripped
