"""A share of one split GPU (side by side, docs/architecture.md): what runtime.memory's lease
table grants and runtime.fakegpu's ledger checks, in a module of its own so neither imports
the other for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Budget:
    """A share of one split GPU: its own lease, taken in turn by `holders`, who together keep
    at most `nbytes` there."""
    name: str
    nbytes: int
    holders: tuple[str, ...]
