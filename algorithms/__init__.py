"""Pure tensor math for PPO and GRPO-family training: no processes, no I/O.

Every function takes [batch, response_len] tensors with a 0/1 mask of the response
tokens that count (tool output and padding are 0), computes in float32 (float64 for
float64 input), and gives finite results on rows that are entirely masked.
"""

from algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from algorithms.aggregate import AGG_MODES, aggregate, masked_mean
from algorithms.entropy import entropy_from_logits
from algorithms.gae import compute_gae
from algorithms.kl import KL_KINDS, kl_estimate
from algorithms.losses import RATIO_LEVELS, policy_loss, value_loss
from algorithms.mismatch import masked_is, mismatch_metrics, reduce_metrics, sequence_masked_is, truncated_is
from algorithms.rewards import token_level_rewards
from algorithms.scan import masked_discounted_cumsum
from algorithms.whiten import masked_moments, masked_whiten, whiten_with_moments

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGG_MODES",
    "KL_KINDS",
    "RATIO_LEVELS",
    "aggregate",
    "compute_advantages",
    "compute_gae",
    "entropy_from_logits",
    "kl_estimate",
    "masked_discounted_cumsum",
    "masked_is",
    "masked_mean",
    "masked_moments",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss",
    "reduce_metrics",
    "sequence_masked_is",
    "token_level_rewards",
    "truncated_is",
    "value_loss",
    "whiten_with_moments",
]
