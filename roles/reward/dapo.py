"""The DAPO math reward: the last ``Answer: ...`` line, Minerva-style normalisation.

Semantics follow DAPO's ``math_dapo_utils.compute_score`` as miles/slime run it:
only the last 300 characters of the response are read (MATH's longest answer is
159 characters), the last ``Answer:`` match (case-insensitive, up to the end of its
line) is the prediction, both sides are normalised, the label is turned into an integer
when it is one (DAPO-Math-17k labels all are), and the strings must then be equal.
Correct scores +1.0 and everything else -1.0 (wrong, missing, unparsable): DAPO
penalises a wrong answer rather than scoring it 0.
"""

import re

_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_NO_ANSWER = "[INVALID]"

# Applied in order; the order matters ("\text{m}" becomes "\text{}", which is later removed).
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Unit words and LaTeX decorations that never change the value of a DAPO answer.
_REMOVED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
    "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
    "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
    "<|im_end|>", "<|endoftext|>",
)  # fmt: skip
_UNWRAP = (
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),
)


def dapo_reward(response: str, label: str) -> float:
    """+1.0 when the last ``Answer:`` in the response's tail matches ``label``, else -1.0."""
    matches = _ANSWER_LINE.findall(response[-_TAIL_CHARS:])
    prediction = normalize_dapo_answer(matches[-1] if matches else _NO_ANSWER)
    return 1.0 if prediction == _normalize_label(label) else -1.0


def normalize_dapo_answer(answer: str) -> str:
    """Minerva normalisation: ``"x = \\$1,000 dollars."`` -> ``"1000"``."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for text in _REMOVED:
        answer = answer.replace(text, "")
    # Keep only the first inline-math span when there is one: "is $5$ now" -> "$5$".
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)
    for pattern, replacement in _UNWRAP:
        answer = pattern.sub(replacement, answer)
    # Shorthand TeX: "\frac12" -> "\frac{1}{2}", "\sqrt3" -> "\sqrt{3}".
    answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _normalize_label(label: str) -> str:
    label = normalize_dapo_answer(label)
    try:
        return str(int(float(label)))
    except (ValueError, OverflowError):
        return label  # not a number: compare the normalised text (miles does the same)
