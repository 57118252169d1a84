"""Reward scorer role: rule rewards, custom reward functions, killable worker processes.

- ``roles.reward.rules.REWARD_RULES``: deepscaler, dapo, math, tiny_exact, tiny_digits
- ``roles.reward.custom.load_reward_function``: ``--custom-rm-path`` loading
- ``roles.reward.scorer.Scorer``: batch scoring with per-sample timeouts
- ``roles.reward.role.RewardScorer``: the actor that serves a ``Scorer``

Nothing is imported here: reward worker processes import this package on start, and
should not pay for sympy (~0.5 s) or the runtime when they run a custom function.
"""
