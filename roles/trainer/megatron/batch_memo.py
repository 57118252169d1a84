"""Tensors derived from one packed micro-batch, computed once for all the layers that read them.

Every layer of a forward (and of its recompute) gets the same PackedSeqParams, so what the
core attention derives from its cu_seqlens (rotary cos/sin, the context-parallel gather
plan) is memoised by that tensor OBJECT and its version counter: a reused buffer that is
overwritten in place misses. A few entries, not one: a pipeline schedule interleaves
micro-batches' forwards and backward recomputes. Cache, not state: `drop` frees it before
device memory is reported (roles.trainer.megatron.env.drop_rotary_cache).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, TypeVar

import torch

T = TypeVar("T")
_MEMO: OrderedDict = OrderedDict()
KEPT = 8


def per_batch(cu_seqlens: torch.Tensor | None, key: Hashable, build: Callable[[], T]) -> T:
    """build(), or its value from an earlier call with the same cu_seqlens object (unchanged
    since) and key. cu_seqlens None (padded batches): memoised by key alone."""
    full = (key, None if cu_seqlens is None else (id(cu_seqlens), cu_seqlens._version))
    hit = _MEMO.get(full)
    # an entry holds cu_seqlens itself, so that id cannot be reused while the entry lives
    if hit is not None and hit[0] is cu_seqlens:
        _MEMO.move_to_end(full)
        return hit[1]
    value = build()
    _MEMO[full] = (cu_seqlens, value)
    while len(_MEMO) > KEPT:
        _MEMO.popitem(last=False)
    return value


def drop() -> None:
    _MEMO.clear()
