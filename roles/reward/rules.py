"""Rule rewards: pure functions ``(response, label) -> float``, keyed by ``--rm-type`` name.

| name | reads | scores |
|---|---|---|
| ``deepscaler`` | the last ``\\boxed{}`` after the last ``</think>`` | 1 / 0 |
| ``dapo`` | the last ``Answer:`` line in the last 300 characters | +1 / -1 |
| ``math`` | the last ``\\boxed{}`` anywhere in the response | 1 / 0 |
| ``tiny_exact`` | the whole response, whitespace-stripped | 1 / 0 |
| ``tiny_digits`` | the same, character by character | share in place, 0 at another length |
"""

from collections.abc import Callable

from roles.reward.boxed import extract_boxed
from roles.reward.dapo import dapo_reward
from roles.reward.equivalence import answers_match

RewardRule = Callable[[str, str], float]


def deepscaler_reward(response: str, label: str) -> float:
    """1.0 when the boxed answer after the reasoning matches ``label``.

    As in deepscaler (and miles/slime), the answer is read after the last ``</think>``,
    or after ``###Response`` for that prompt format. A response with neither never
    finished thinking (it was truncated) and scores 0, even if it contains a box.
    """
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response", 2)[1]
    else:
        return 0.0
    return _boxed_answer_reward(solution, label)


def math_reward(response: str, label: str) -> float:
    """1.0 when the last boxed answer anywhere in the response matches ``label``."""
    return _boxed_answer_reward(response, label)


def tiny_exact_reward(response: str, label: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly ``label``.

    For the generated tiny tasks (``ppo.prompts.tasks``): the response is the decoded text up to
    EOS, e.g. ``"7"`` for the prompt ``"3+4="``; ``" 7\\n"`` counts, ``"07"`` does not.
    """
    return 1.0 if response.strip() == label.strip() else 0.0


def tiny_digits_reward(response: str, label: str) -> float:
    """The share of the label's characters the response has in place, 0 unless the two
    (whitespace-stripped) have the same length: partial credit for the generated tiny tasks
    whose answers have several digits, so each digit is learned from its own signal; 1.0
    only for an exact answer, as ``tiny_exact``."""
    response, label = response.strip(), label.strip()
    if not label or len(response) != len(label):
        return 0.0
    return sum(r == l for r, l in zip(response, label)) / len(label)


def _boxed_answer_reward(solution: str, label: str) -> float:
    answer = extract_boxed(solution)
    if answer is None:
        return 0.0
    truth = extract_boxed(label) if "\\boxed" in label else label
    if not truth:
        return 0.0  # an empty label matches nothing, not even an empty box
    return 1.0 if answers_match(answer, truth) else 0.0


REWARD_RULES: dict[str, RewardRule] = {
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "math": math_reward,
    "tiny_exact": tiny_exact_reward,
    "tiny_digits": tiny_digits_reward,
}
