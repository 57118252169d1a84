"""Per-token KL estimators between the policy and a reference (Schulman's k1/k2/k3)."""

import torch

from algorithms._tensors import compute_dtype

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")

# low_var_kl bounds, as in verl and miles: the log ratio before exp, the result after.
_LOG_RATIO_CLAMP = 20.0
_LOW_VAR_KL_CLAMP = 10.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs.

    With d = logp - ref_logp (tokens sampled from the policy):
      k1          d                      unbiased, can be negative
      k2          d**2 / 2               biased, low variance
      k3          exp(-d) - 1 + d        unbiased, never negative
      low_var_kl  k3 with d clamped to +-20 and the result to [-10, 10]
    Same shape as the inputs; apply the mask when reducing (see aggregate).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"KL kind must be one of {KL_KINDS}, got {kind!r}")
    dtype = compute_dtype(logp, ref_logp)
    log_ratio = logp.to(dtype) - ref_logp.to(dtype)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = torch.expm1(-log_ratio) + log_ratio
    if kind == "low_var_kl":
        return k3.clamp(-_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP)
    return k3
