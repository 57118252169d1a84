"""The actor's and the critic's micro-batch objectives, one for both backends.

Each takes the model's outputs on one micro-batch as [n, Rm] rows (a torch backend
roles.trainer.batching.MicroBatch, or a megatron packed micro-batch turned back into rows)
and the aggregation counts of the WHOLE mini-batch (algorithms.aggregate's sharding
contract), so the micro-batch losses sum to the mini-batch's loss however it was split.
Metrics are scaled the same way: their sum over a mini-batch's micro-batches is its value.
`mb` needs only `.response` (response-aligned inputs) and `.valid` (the loss mask).
"""

from __future__ import annotations

import torch

from algorithms import aggregate, kl_estimate, policy_loss, value_loss
from roles.trainer.config import TrainerConfig

Objective = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (loss, metrics)


def token_share(mb, counts: dict) -> float:
    """Weight of this micro-batch's token-mean metrics in its mini-batch's."""
    return int(mb.valid.sum()) / max(counts["global_token_count"], 1)


def optional_train_keys(batch: dict) -> tuple[str, ...]:
    """Response-aligned inputs the policy objective reads when the driver sends them:
    tis_weights [N, R], per-token importance weights (--use-tis)."""
    return tuple(k for k in ("tis_weights",) if k in batch)


def policy_objective(cfg: TrainerConfig, log_probs: torch.Tensor, entropy: torch.Tensor | None, mb, counts: dict
                     ) -> Objective:
    """The PPO policy objective: clipped policy loss, minus entropy_coef * entropy, plus
    kl_loss_coef * KL to the reference, each aggregated by loss_agg_mode. The ratio is per
    token or, for GSPO, per sequence (cfg.ratio_level); tis_weights, when the driver sends
    them, weight each token's policy loss.

    log_probs, entropy: [n, Rm]; entropy None when neither entropy_coef nor log_entropy asks
    for it. Metrics: pg_loss, pg_clipfrac, ppo_kl, entropy_loss (with entropy), kl_loss
    (with use_kl_loss).
    """
    r = {k: v.to(log_probs.device) for k, v in mb.response.items()}
    valid = mb.valid.to(log_probs.device)
    pg_loss, pg_metrics = policy_loss(
        log_probs, r["old_log_probs"], r["advantages"], valid,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
        agg=cfg.loss_agg_mode, ratio_level=cfg.ratio_level, is_weights=r.get("tis_weights"), **counts,
    )
    share = token_share(mb, counts)
    metrics = {k: pg_metrics[k] * share for k in ("pg_clipfrac", "ppo_kl", "ois") if k in pg_metrics}
    metrics["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if entropy is not None:
        entropy_loss = aggregate(entropy, valid, cfg.loss_agg_mode, **counts)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    if cfg.use_kl_loss:
        kl = kl_estimate(log_probs, r["ref_log_probs"], cfg.kl_loss_type)
        kl_loss = aggregate(kl, valid, cfg.loss_agg_mode, **counts)
        if cfg.kl_loss_coef != 0:
            loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics


def value_objective(cfg: TrainerConfig, values: torch.Tensor, mb, counts: dict) -> Objective:
    """The critic objective: the clipped value loss against the returns (value_clip around
    the old values), aggregated by loss_agg_mode.

    values: [n, Rm]. Metrics: value_loss, value_clipfrac.
    """
    r = {k: v.to(values.device) for k, v in mb.response.items()}
    loss, metrics = value_loss(
        values, r["old_values"], r["returns"], mb.valid.to(values.device),
        value_clip=cfg.value_clip, agg=cfg.loss_agg_mode, **counts,
    )
    return loss, {
        "value_loss": loss.detach(),
        "value_clipfrac": metrics["value_clipfrac"] * token_share(mb, counts),
    }
