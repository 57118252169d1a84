"""Log-probs and entropy from vocab-parallel output weights, in row chunks (pure torch).

With tensor parallelism each TP rank holds rows [start, start + Vs) of the (TP-padded)
output weight, so it sees only its slice of every logit row. Per chunk of rows:

    m   = max over the vocab     local max, all-reduced (MAX) over the TP group; no gradient
    S   = sum exp(z - m)         local sums, all-reduced (SUM)
    z_t = the target's logit     taken on the rank that owns the target id, 0 elsewhere, SUM
    log p(t) = z_t - m - log S,  entropy = m + log S - sum(exp(z - m) * z) / S

Every rank of the TP group ends with the same log-probs, as megatron's vocab-parallel cross
entropy does: the loss is computed once per TP group (replicated), not summed over it. So
the SUM all-reduce passes its gradient through unchanged (each rank's slice reaches the
replicated loss only through the sum), and the hidden states, replicated on every TP rank,
get the SUM over ranks of their per-slice gradients (`copy_to_group`, megatron's
copy_to_tensor_model_parallel_region). Without a group (group=None) this is the plain
full-vocab computation.

At most `chunk` rows of float32 logits exist at once, forward and backward: under autograd
each chunk is checkpointed (its collectives run again, in the same order on every rank,
when backward recomputes it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


class _SumOverGroup(torch.autograd.Function):
    """All-reduce SUM; the gradient passes through (the result feeds a replicated loss)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToGroup(torch.autograd.Function):
    """Identity; the gradient is all-reduced (SUM) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SumOverGroup.apply(x, group)


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToGroup.apply(x, group)


def _chunk(hidden, weight, targets, vocab_start: int, temperature: float, with_entropy: bool,
           entropy_grad: bool, group):
    logits = (hidden @ weight.t()).float() / temperature  # [c, Vs] float32: one chunk at a time
    m = logits.detach().max(dim=-1).values
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - m[:, None]
    e = shifted.exp()
    log_s = sum_over_group(e.sum(-1), group).log()
    local = targets - vocab_start
    owned = (local >= 0) & (local < weight.shape[0])
    target_logit = shifted.gather(-1, local.clamp(0, weight.shape[0] - 1)[:, None]).squeeze(-1) * owned
    log_probs = sum_over_group(target_logit, group) - log_s
    if not with_entropy:
        return log_probs, log_probs.new_zeros(())
    src_e, src_shifted = (e, shifted) if entropy_grad else (e.detach(), shifted.detach())
    s, ez = sum_over_group(torch.stack([src_e.sum(-1), (src_e * src_shifted).sum(-1)]), group)
    entropy = s.log() - ez / s  # log S - E[z - m]: the entropy (the shift by m cancels)
    return log_probs, entropy


def vocab_parallel_log_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             vocab_start: int, temperature: float, chunk: int, with_entropy: bool,
                             entropy_grad: bool = True, group=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) [Nr] float32 and the entropy [Nr] (when asked).

    hidden [Nr, H] (the same on every rank of `group`), weight [Vs, H]: this rank's rows
    of the output weight, global vocab ids vocab_start..vocab_start+Vs-1, TP padding rows
    already cut; targets [Nr] global ids. Logits are divided by the rollout temperature, as
    the torch backend does. group=None: weight is the whole vocab (vocab_start=0).
    """
    hidden = copy_to_group(hidden, group)
    parts_lp, parts_ent = [], []
    # at least one chunk, even of no rows: the collectives run on every TP rank, and the
    # ranks of one TP group always hold the same rows
    for start in range(0, max(hidden.shape[0], 1), chunk):
        args = (hidden[start:start + chunk], weight, targets[start:start + chunk], vocab_start, temperature,
                with_entropy, entropy_grad, group)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        parts_lp.append(lp)
        parts_ent.append(ent)
    log_probs = torch.cat(parts_lp)
    return log_probs, torch.cat(parts_ent) if with_entropy else None


def vocab_shard(weight: torch.Tensor, *, vocab_size: int, tp_rank: int) -> tuple[torch.Tensor, int]:
    """(the rows of this TP rank's output-weight shard that are real vocab ids, the first id):
    megatron pads the vocab to a multiple of TP and those rows never count."""
    start = tp_rank * weight.shape[0]
    return weight[:max(0, min(weight.shape[0], vocab_size - start))], start
