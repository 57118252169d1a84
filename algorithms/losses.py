"""PPO clipped policy loss (token or sequence ratio, GSPO) and clipped value loss, per token then aggregated."""

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens
from algorithms.aggregate import Count, aggregate, masked_mean

# exp(20) ~ 5e8: a ratio past this is a numerical accident, not a policy change.
_LOG_RATIO_CLAMP = 20.0
# token: PPO's per-token ratio; sequence: GSPO's length-normalised sequence ratio.
RATIO_LEVELS = ("token", "sequence")


def _metric(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_mean(values.detach().to(torch.float32), mask)


def policy_loss(
    logp: torch.Tensor,  # [B, T] current policy
    old_logp: torch.Tensor,  # [B, T] policy that sampled the tokens
    advantages: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    agg: str = "sum-of-sample-mean",
    global_batch_size: Count | None = None,
    global_token_count: Count | None = None,
    ratio_level: str = "token",
    is_weights: torch.Tensor | None = None,  # [B, T]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss (to minimise) and detached float32 metrics.

    ratio = exp(clamp(logp - old_logp, -20, 20)), clipped to
    [1 - eps_clip, 1 + (eps_clip_high or eps_clip)] (eps_clip_high > eps_clip is DAPO's
    clip-higher). Per token: max(-A * ratio, -A * clip(ratio)). With eps_clip_c (dual
    clip, must be > 1) tokens with A < 0 are further capped at -A * eps_clip_c, so a
    huge ratio on a bad token cannot blow up the loss. Reduced by aggregate(agg, ...).

    ratio_level="sequence" is GSPO (Zheng et al. 2025, eq. 5-7): every token of a response
    takes the response's ratio s = exp(mean over its valid tokens of (logp - old_logp)), the
    length-normalised sequence likelihood ratio, clipped as above (the paper clips with far
    smaller eps, 3e-4 / 4e-4). The gradient flows through the mean into every token. With
    agg="sum-of-sample-mean" or "seq-mean-token-mean" the loss is the paper's mean over
    responses; other modes weight the responses by length.

    is_weights: per-token importance weights (e.g. TIS, algorithms.mismatch), treated as
    constants and multiplied into each token's loss after clipping, as in miles; a 0 drops
    the token from the numerator only, so the denominators stay those of `mask`.

    Metrics (token means over valid tokens):
      pg_clipfrac        tokens where the clipped term is the active one
      pg_clipfrac_lower  tokens where the dual clip is active (0 without eps_clip_c)
      ppo_kl             mean of old_logp - logp (k1 estimate of KL(old || new)); with
                         ratio_level="sequence", of the sequence's mean (miles' GSPO KL)
      ois                mean ratio (only with is_weights; miles' name)
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in (0, 1), got {eps_clip}")
    if not eps_high > 0.0:
        raise ValueError(f"eps_clip_high must be > 0, got {eps_clip_high}")
    if eps_clip_c is not None and not eps_clip_c > 1.0:
        raise ValueError(f"eps_clip_c (dual-clip lower bound on the ratio) must be > 1, got {eps_clip_c}")
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    valid = valid_tokens(mask, logp=logp, old_logp=old_logp, advantages=advantages, is_weights=is_weights)
    dtype = compute_dtype(logp, old_logp, advantages)
    log_ratio = masked(logp, valid, dtype) - masked(old_logp, valid, dtype)
    if ratio_level == "sequence":
        n = valid.sum(-1, keepdim=True).clamp_min(1).to(dtype)
        log_ratio = torch.where(valid, (log_ratio.sum(-1, keepdim=True) / n).expand_as(log_ratio), 0.0)
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = masked(advantages, valid, dtype)

    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    per_token = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if eps_clip_c is None:
        dual_active = torch.zeros_like(clip_active)
    else:
        dual_cap = -adv * eps_clip_c
        dual_active = (adv < 0) & (per_token > dual_cap)
        per_token = torch.where(adv < 0, torch.minimum(per_token, dual_cap), per_token)
    if is_weights is not None:
        per_token = per_token * masked(is_weights, valid, dtype).detach()

    loss = aggregate(per_token, valid, agg, global_batch_size, global_token_count)
    metrics = {
        "pg_clipfrac": _metric(clip_active, valid),
        "pg_clipfrac_lower": _metric(dual_active, valid),
        "ppo_kl": _metric(-log_ratio, valid),
    }
    if is_weights is not None:
        metrics["ois"] = _metric(ratio, valid)
    return loss, metrics


def value_loss(
    values: torch.Tensor,  # [B, T] current critic
    old_values: torch.Tensor,  # [B, T] critic when the batch was scored
    returns: torch.Tensor,  # [B, T]
    mask: torch.Tensor,  # [B, T]
    value_clip: float | None = 0.2,
    agg: str = "sum-of-sample-mean",
    global_batch_size: Count | None = None,
    global_token_count: Count | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss max((v - R)**2, (clip(v, v_old - c, v_old + c) - R)**2), aggregated.

    No 0.5 factor: the critic is its own model with its own optimiser, as in miles, so
    the scale only sets its effective learning rate. value_clip=None disables clipping.
    Metric value_clipfrac: valid tokens where the clipped term is the larger one.
    """
    if value_clip is not None and not value_clip > 0.0:
        raise ValueError(f"value_clip must be > 0 (or None for no clipping), got {value_clip}")
    valid = valid_tokens(mask, values=values, old_values=old_values, returns=returns)
    dtype = compute_dtype(values, old_values, returns)
    v = masked(values, valid, dtype)
    target = masked(returns, valid, dtype)
    unclipped = (v - target).square()
    if value_clip is None:
        per_token = unclipped
        clip_active = torch.zeros_like(valid)
    else:
        v_old = masked(old_values, valid, dtype)
        clipped = (v_old + (v - v_old).clamp(-value_clip, value_clip) - target).square()
        per_token = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = aggregate(per_token, valid, agg, global_batch_size, global_token_count)
    return loss, {"value_clipfrac": _metric(clip_active, valid)}
