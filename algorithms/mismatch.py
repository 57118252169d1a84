"""Training-inference mismatch: importance weights that correct for it, and metrics that show it.

The engine samples from pi_rollout; the trainer computes pi_train of the same tokens with the
same weights, and the two differ (kernels, batch shapes, precision). The PPO ratio is taken
against pi_train (old_log_probs), so the samples are slightly off-policy for it. Truncated
importance sampling (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training") multiplies each token's policy loss by

    w_t = min(pi_train(a_t) / pi_rollout(a_t), C)

miles adds a lower bound (`--tis-clip-low`, default 0, which is the paper's TIS) and
offers the masked variant (icepop: tokens whose ratio leaves [low, C] get weight 0, the
others keep their ratio) through `--custom-tis-function-path`; so does Tandem, with the
functions below. A weight of 0 rejects a token without changing the loss's denominators
(miles: "modified masks correct the numerator only").

A TIS function (built in or custom) is called as

    fn(train_log_probs=[B, T], rollout_log_probs=[B, T], mask=[B, T], tis_clip=C, tis_clip_low=c)

and returns (weights [B, T], metrics {name: [B, T]}): weights are detached and 0 at masked
positions; each metric is per token (a sequence-level value repeated over its tokens), and
`reduce_metrics` turns them into one number each, as miles' sum_of_sample_mean does.
"""

from __future__ import annotations

import torch

from algorithms._tensors import compute_dtype, masked, valid_tokens
from algorithms.aggregate import aggregate

# exp(20) ~ 5e8: a log-ratio past this is an accident (a token the engine sampled at ~0
# probability), clamped so that weights and metrics stay finite (miles' SAFETY_BOUND).
SAFETY_BOUND = 20.0


def _log_ratio(train_log_probs, rollout_log_probs, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(log pi_train - log pi_rollout, clamped to +-SAFETY_BOUND and 0 where masked; valid)."""
    valid = valid_tokens(mask, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs)
    dtype = compute_dtype(train_log_probs, rollout_log_probs)
    diff = masked(train_log_probs, valid, dtype) - masked(rollout_log_probs, valid, dtype)
    return diff.detach().clamp(-SAFETY_BOUND, SAFETY_BOUND), valid


def _check_bounds(tis_clip: float, tis_clip_low: float) -> None:
    if not 0.0 <= tis_clip_low < tis_clip:
        raise ValueError(f"TIS bounds must satisfy 0 <= tis_clip_low < tis_clip, got "
                         f"tis_clip_low={tis_clip_low}, tis_clip={tis_clip}")


def truncated_is(*, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                 tis_clip: float = 2.0, tis_clip_low: float = 0.0
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TIS (the default of --use-tis): w = clamp(ratio, tis_clip_low, tis_clip) per token.

    Metrics (miles' names): tis (the ratio before clamping), tis_abs (|ratio - 1|),
    tis_clipfrac (tokens whose weight is not their ratio), tis_weight (the weight).
    """
    _check_bounds(tis_clip, tis_clip_low)
    log_ratio, valid = _log_ratio(train_log_probs, rollout_log_probs, mask)
    ratio = torch.exp(log_ratio)
    weights = ratio.clamp(tis_clip_low, tis_clip)
    return torch.where(valid, weights, 0.0), _metrics(ratio, weights, valid)


def masked_is(*, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
              tis_clip: float = 2.0, tis_clip_low: float = 0.0
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked IS (miles' icepop_function): w = ratio where tis_clip_low <= ratio <= tis_clip,
    else 0 (the token is rejected). Select with
    --custom-tis-function-path algorithms.mismatch:masked_is. Metrics as truncated_is."""
    _check_bounds(tis_clip, tis_clip_low)
    log_ratio, valid = _log_ratio(train_log_probs, rollout_log_probs, mask)
    ratio = torch.exp(log_ratio)
    keep = (ratio >= tis_clip_low) & (ratio <= tis_clip)
    weights = torch.where(keep, ratio, 0.0)
    return torch.where(valid, weights, 0.0), _metrics(ratio, weights, valid)


def sequence_masked_is(*, train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                       tis_clip: float = 2.0, tis_clip_low: float = 0.0
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level rejection (MIS, miles' mis.py with tis_level=geometric, tis_mode=mask):
    a sequence whose geometric-mean ratio exp(mean_t log ratio_t) leaves [tis_clip_low,
    tis_clip] gets weight 0 on every token; the others keep their truncated token weights
    clamp(ratio_t, tis_clip_low, tis_clip). Metrics as truncated_is, plus
    tis_seq_rejectfrac (rejected sequences; per token, so its reduction is their share)."""
    _check_bounds(tis_clip, tis_clip_low)
    log_ratio, valid = _log_ratio(train_log_probs, rollout_log_probs, mask)
    ratio = torch.exp(log_ratio)
    n = valid.sum(-1, keepdim=True).clamp_min(1)
    seq_ratio = torch.exp(log_ratio.sum(-1, keepdim=True) / n)  # [B, 1]
    keep = (seq_ratio >= tis_clip_low) & (seq_ratio <= tis_clip)
    weights = torch.where(keep, ratio.clamp(tis_clip_low, tis_clip), 0.0)
    metrics = _metrics(ratio, weights, valid)
    metrics["tis_seq_rejectfrac"] = (~keep).to(ratio.dtype).expand_as(ratio)
    return torch.where(valid, weights, 0.0), metrics


def _metrics(ratio: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tis": ratio, "tis_abs": (ratio - 1).abs(), "tis_clipfrac": (weights != ratio).to(ratio.dtype),
            "tis_weight": weights}


def mismatch_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """--get-mismatch-metrics: per-token [B, T] metrics of pi_train against pi_rollout, with
    the names of miles' mis.py (add_ppl_metrics), in float64, to reduce with `reduce_metrics`:

      training_log_ppl, rollout_log_ppl   -mean_t log p of the sequence (each engine)
      training_ppl, rollout_ppl           exp of those
      log_ppl_diff, log_ppl_abs_diff      rollout mean log p - training mean log p (and |.|)
      ppl_ratio                           exp(log_ppl_diff) = training ppl / rollout ppl
      kl                                  log p_rollout - log p_train (k1 of KL(rollout || train))
      k3_kl                               r - log r - 1, r = p_train / p_rollout (k3, >= 0)
      chi2_token                          mean_t r_t^2 - 1 over the sequence's tokens
      chi2_seq                            (prod_t r_t)^2 - 1, log of the product clamped to +-20

    Sequence values are repeated over the sequence's tokens. miles computes chi2_token over
    the whole micro-batch; here it is per sequence, so the value does not depend on how the
    batch is split.
    """
    # float64 whatever the input: gaps of ~1e-7 (engines that agree) square to ~1e-14
    train_log_probs, rollout_log_probs = train_log_probs.double(), rollout_log_probs.double()
    log_ratio, valid = _log_ratio(train_log_probs, rollout_log_probs, mask)
    dtype = log_ratio.dtype
    n = valid.sum(-1, keepdim=True).clamp_min(1).to(dtype)
    train = masked(train_log_probs, valid, dtype).detach()
    rollout = masked(rollout_log_probs, valid, dtype).detach()
    mean_train, mean_rollout = train.sum(-1, keepdim=True) / n, rollout.sum(-1, keepdim=True) / n
    log_ppl_diff = mean_rollout - mean_train
    seq = {
        "training_log_ppl": -mean_train, "training_ppl": torch.exp(-mean_train),
        "rollout_log_ppl": -mean_rollout, "rollout_ppl": torch.exp(-mean_rollout),
        "log_ppl_diff": log_ppl_diff, "log_ppl_abs_diff": log_ppl_diff.abs(), "ppl_ratio": torch.exp(log_ppl_diff),
        # expm1: x ~1e-7 is below the resolution of 1 + x, even in float64 for x ~1e-17
        "chi2_token": torch.where(valid, torch.expm1(2 * log_ratio), 0.0).sum(-1, keepdim=True) / n,
        "chi2_seq": torch.expm1(2 * log_ratio.sum(-1, keepdim=True).clamp(-SAFETY_BOUND, SAFETY_BOUND)),
    }
    out = {k: v.expand_as(log_ratio) for k, v in seq.items()}
    out["kl"] = -log_ratio
    out["k3_kl"] = torch.expm1(log_ratio) - log_ratio
    return out


def reduce_metrics(metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
    """Each [B, T] metric's mean over each sequence's valid tokens, then over the sequences
    that have any (seq-mean-token-mean; miles' sum_of_sample_mean for metrics)."""
    valid = mask != 0
    return {k: float(aggregate(v.detach(), valid, "seq-mean-token-mean")) for k, v in metrics.items()}
