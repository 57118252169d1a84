"""Rule rewards against a fixture of math answers, and the pieces they are built from."""

import json
import time
import types
from pathlib import Path

import pytest

from roles.reward import equivalence
from roles.reward.boxed import extract_boxed
from roles.reward.dapo import normalize_dapo_answer
from roles.reward.equivalence import answers_match, normalize_for_sympy, sympy_equal
from roles.reward.mathd import normalize_mathd
from roles.reward.rules import REWARD_RULES

FIXTURE = Path(__file__).parent / "fixtures" / "math_answers.jsonl"
CASES = [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("rule", ["deepscaler", "dapo", "math"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_rule_scores_fixture_answer(case, rule):
    started = time.monotonic()
    assert REWARD_RULES[rule](case["response"], case["label"]) == case[rule]
    # The sympy guard must turn huge expressions away, not evaluate them.
    assert time.monotonic() - started < 2.0


def test_fixture_covers_both_outcomes_of_every_rule():
    for rule in ("deepscaler", "dapo", "math"):
        assert {case[rule] for case in CASES} == ({1, -1} if rule == "dapo" else {1, 0})


def test_registry_names_match_config_rm_types():
    assert set(REWARD_RULES) == {"deepscaler", "dapo", "math", "tiny_exact", "tiny_digits"}


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [("7", "7", 1.0), (" 7\n", "7", 1.0), ("07", "7", 0.0), ("7 ", "8", 0.0), ("", "7", 0.0), ("-3", "-3", 1.0)],
)
def test_tiny_exact_compares_stripped_response(response, label, expected):
    assert REWARD_RULES["tiny_exact"](response, label) == expected


@pytest.mark.parametrize(
    ("response", "label", "expected"),
    [("64", "64", 1.0), (" 64\n", "64", 1.0), ("54", "64", 0.5), ("63", "64", 0.5), ("46", "64", 0.0),
     ("6", "64", 0.0), ("640", "64", 0.0), ("", "", 0.0), ("7", "7", 1.0)],
)
def test_tiny_digits_credits_each_digit_in_place_only_at_the_labels_length(response, label, expected):
    assert REWARD_RULES["tiny_digits"](response, label) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("\\boxed{7}", "7"),
        ("a \\boxed{1} b \\boxed{\\frac{1}{2}} c", "\\frac{1}{2}"),
        ("\\boxed{{a}{b}}", "{a}{b}"),
        ("\\boxed 42 is it", "42"),
        ("$\\boxed 42$", "42"),
        ("\\fbox{x+1}", "x+1"),
        ("\\boxed{7", None),
        ("\\boxed{}", ""),
        ("\\boxed", None),
        ("\\boxedx", None),
        ("no box", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("\\dfrac12", "\\frac{1}{2}"),
        ("0.5", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        ("\\frac1{72}", "\\frac{1}{72}"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("90^\\circ", "90"),
        ("5 \\text{ cm}", "5"),
        ("\\text{five}", "five"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("k = 5", "5"),
        (".25", "0.25"),
    ],
)
def test_normalize_mathd(raw, normal):
    assert normalize_mathd(raw) == normal


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("1,000,000", "1000000"),
        ("\\$1,000", "1000"),
        ("12.0", "12"),
        ("5.", "5"),
        ("3 million", "3*10^6"),
        ("10 meters", "10"),
        ("\\frac{1}{2}", "1/2"),
        ("\\frac{x+1}{2}", "(x+1)/(2)"),
        ("3\\frac{1}{2}", "3+1/2"),
        ("\\sqrt{12}", "sqrt(12)"),
        ("\\text{Yes}", "yes"),
    ],
)
def test_normalize_for_sympy(raw, normal):
    assert normalize_for_sympy(raw) == normal


def test_sympy_equal_handles_algebra():
    assert sympy_equal("(x+1)^2", "x^2+2*x+1")
    assert sympy_equal("sqrt(12)", "2sqrt(3)")
    assert not sympy_equal("x+1", "x+2")


@pytest.mark.parametrize(
    "expr",
    [
        "9^99",  # two-digit exponent
        "9^9^9",  # chained powers
        "2^(100)",  # parenthesised exponent
        "2**99999999",  # python power syntax
        "x" * 300,  # too long
        "abc+d",  # more than two unknowns
        "__import__('os').getpid()",  # not math: never reaches eval
        "5!",  # factorial of anything large hangs
    ],
)
def test_sympy_guard_refuses_dangerous_or_slow_input(expr):
    started = time.monotonic()
    assert not sympy_equal(expr, "1")
    assert time.monotonic() - started < 0.5


def test_integer_label_needs_integer_answer():
    assert not answers_match("4.0000001", "4")
    assert answers_match("4.0", "4")


def test_math_verify_is_used_when_installed(monkeypatch):
    calls = []

    def verify(gold, answer):
        calls.append((gold, answer))
        return True

    fake = types.SimpleNamespace(parse=lambda text: text, verify=verify)
    monkeypatch.setattr(equivalence, "math_verify", fake)
    # No string or sympy rule relates these; only the (fake) math_verify accepts them.
    assert answers_match("\\alpha", "\\beta")
    assert calls == [("$\\beta$", "$\\alpha$")]


def test_math_verify_errors_count_as_no_match(monkeypatch):
    def verify(gold, answer):
        raise RuntimeError("cannot parse")

    monkeypatch.setattr(equivalence, "math_verify", types.SimpleNamespace(parse=lambda t: t, verify=verify))
    assert not answers_match("\\alpha", "\\beta")


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("x = \\$1,000 dollars", "1000"),
        ("$\\frac12$", "\\frac{1}{2}"),
        ("\\boxed{12}", "12"),
        ("\\text{(A)}", "(A)"),
        ("90^\\circ", "90"),
        ("a 5", "5"),
    ],
)
def test_normalize_dapo_answer(raw, normal):
    assert normalize_dapo_answer(raw) == normal
