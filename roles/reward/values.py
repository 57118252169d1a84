"""What counts as a reward: a finite real number, or a dict from which ``--reward-key`` picks one.

As in miles (``Sample.get_reward_value``: "some reward model may return a dict instead of a
value"), a reward function or service may answer with several numbers; ``reward_key`` names
the one that is the reward. Anything else is an error of the sample, not of the scorer.
"""

import math
import numbers


def reward_value(result, reward_key: str | None, source: str) -> float:
    """The reward in `result` (from `source`, for the message); TypeError/ValueError if none."""
    if isinstance(result, dict):
        if reward_key is None:
            raise TypeError(f"{source} returned a dict {_short(result)}; set --reward-key to the key of the reward")
        if reward_key not in result:
            raise ValueError(f"{source} returned a dict without --reward-key {reward_key!r}: {_short(result)}")
        result = result[reward_key]
    if not isinstance(result, numbers.Real):
        raise TypeError(f"{source} returned {type(result).__name__} {_short(result)}, expected a float")
    value = float(result)
    if not math.isfinite(value):
        raise ValueError(f"{source} returned {value}, expected a finite float")
    return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
