"""A slot-based KV cache carved out of one buffer allocated once from a byte budget.

The buffer is allocated when the cache is resumed and freed when it is released; nothing
else allocates KV memory. Each generate call picks a geometry for it: `slot_len` positions
per sequence (the call's longest prompt + max_new_tokens, plus the decode steps that may run
past a finish before the host sees it) and as many slots as fit the budget, up to
`max_slots`. A slot holds one sequence from position 0, so a batch row IS a slot and decode
attention reads `cache[:B]` without a gather.

Layout: [layers, 2 (k, v), slots, kv_heads, slot_len, head_dim], so one slot's keys for one
head are contiguous along positions (what batched attention wants) and the leading slots
`[:B]` of a layer form one strided view.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roles.device import DeviceMemory


@dataclass(frozen=True)
class Geometry:
    num_slots: int
    slot_len: int


class KVCache:
    def __init__(self, *, memory: DeviceMemory, num_bytes: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, max_slots: int):
        self.memory = memory
        self.num_bytes = num_bytes
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = dtype
        self.max_slots = max_slots
        self.bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        self._buffer: torch.Tensor | None = None  # flat, num_bytes // itemsize elements
        self.geometry: Geometry | None = None
        self.view: torch.Tensor | None = None  # [L, 2, S, KV, T, D] over the buffer

    def allocate(self) -> None:
        self.memory.account("kv_cache", self.num_bytes)  # first: a lease violation must not allocate
        numel = self.num_bytes // self.dtype.itemsize
        # zeros, not empty: attention weighs masked positions by 0, and 0 * NaN garbage is NaN
        self._buffer = torch.zeros(numel, dtype=self.dtype, device=self.memory.device)
        self.geometry = self.view = None

    def free(self) -> None:
        self._buffer = self.view = self.geometry = None
        if self.memory.kind == "cuda":
            torch.cuda.empty_cache()  # hand the blocks back to the driver for the next lease holder
        self.memory.account("kv_cache", 0)

    def geometry_for(self, longest: int) -> Geometry:
        """Slots of `longest` positions, as many as the budget holds (at most max_slots).

        num_slots is 0 when not even one sequence of that length fits (the caller says which).
        """
        per_slot = longest * self.bytes_per_token
        return Geometry(num_slots=min(self.max_slots, self.num_bytes // per_slot), slot_len=longest)

    def shape(self, geometry: Geometry) -> None:
        """View the buffer with `geometry` (free: a reshape of the same memory)."""
        if geometry == self.geometry:
            return
        s = geometry
        numel = self.num_layers * 2 * s.num_slots * self.num_kv_heads * s.slot_len * self.head_dim
        self.view = self._buffer[:numel].view(
            self.num_layers, 2, s.num_slots, self.num_kv_heads, s.slot_len, self.head_dim)
        self.geometry = geometry

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of layer i, each [S, KV, T, D]."""
        return self.view[i, 0], self.view[i, 1]
