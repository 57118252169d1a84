"""Context-parallel slicing of a packed micro-batch, and reassembly of per-row outputs (pure torch).

megatron's load-balanced causal layout (roles.trainer.megatron.attention.cp_local_index):
every sequence, padded to a multiple of 2*cp (roles.trainer.megatron.packing.pack), is cut
into 2*cp chunks and CP rank r holds chunks r and 2*cp-1-r. A rank runs the model on its
tokens only, with the cu_seqlens / max_seqlen of the WHOLE padded sequences (what the
attention module and megatron's THD rotary embedding read). megatron's THD RoPE derives
positions from cu_seqlens and the layout; `position_ids` are sliced too, for the record.

Outputs are per response row (a packed position whose next token is a response token):
each rank computes the rows it holds, and `gather_rows` puts every rank's rows back in the
micro-batch's row order on every CP rank. Each CP rank then computes the same (replicated)
loss; the gradient of a row reaches only the rank that computed it (backward takes this
rank's slice, no sum), and megatron's DDP sums parameter gradients over dp x cp, so every
token's gradient counts once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from roles.trainer.megatron.attention import cp_local_index
from roles.trainer.megatron.packing import PackedMicroBatch


@dataclass(kw_only=True)
class CPSlice:
    """What CP rank `cp_rank` of `cp_size` runs of one packed micro-batch."""

    cp_size: int
    cp_rank: int
    index: torch.Tensor  # [t] positions in the packed micro-batch of this rank's tokens, in its order
    input_ids: torch.Tensor  # [t]
    position_ids: torch.Tensor  # [t]
    local_rows: torch.Tensor  # [nr] positions in `index` of the response rows this rank holds
    targets: torch.Tensor  # [nr] the tokens those rows predict
    row_order: torch.Tensor  # [Nr] where each micro-batch row sits in the concatenation of all ranks' tokens


def cp_slice(mb: PackedMicroBatch, cp_size: int, cp_rank: int) -> CPSlice:
    """This rank's tokens of `mb` (cp_size=1: all of them, in order)."""
    seqlens = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
    if cp_size == 1:
        index = order = torch.arange(mb.num_tokens)
    else:
        index = cp_local_index(seqlens, cp_size, cp_rank)
        order = torch.cat([cp_local_index(seqlens, cp_size, r) for r in range(cp_size)])
    where = torch.empty_like(order)
    where[order] = torch.arange(len(order))  # packed position -> place in the concatenation
    is_row = torch.zeros(mb.num_tokens, dtype=torch.bool)
    is_row[mb.rows] = True
    local_rows = is_row[index].nonzero().squeeze(-1)
    return CPSlice(cp_size=cp_size, cp_rank=cp_rank, index=index, input_ids=mb.input_ids[index],
                   position_ids=mb.position_ids[index], local_rows=local_rows,
                   targets=mb.input_ids[index[local_rows] + 1], row_order=where[mb.rows])


class _GatherOwnGrad(torch.autograd.Function):
    """All-gather along dim 0; backward returns this rank's slice of the gradient (the
    gathered tensor feeds a loss that every rank computes whole, see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


def gather_rows(values: torch.Tensor, piece: CPSlice, group) -> torch.Tensor:
    """[nr] values at this rank's local rows -> [Nr] in the micro-batch's row order, on every
    CP rank (group=None with cp_size 1)."""
    if piece.cp_size == 1:
        return values  # local rows are the micro-batch's rows, in order (rows increase)
    local = values.new_zeros(len(piece.index)).index_put((piece.local_rows.to(values.device),), values)
    return _GatherOwnGrad.apply(local, group)[piece.row_order.to(values.device)]
