"""What each KV-cache slot still holds after its request finished, so that a trajectory's next
turn (its old context + the engine's answer + a tool turn) prefills only the new tokens.

A finished request leaves its prompt and all but its last sampled token in its slot (the last
one was never fed back). A later request whose ids start with those of a free slot, past the
first generated token, takes that slot and reuses the matched positions. Only continuations are
matched, never a bare shared prompt: a single-turn rollout computes exactly what it computed
before this table existed. The table is forgotten whenever the cache's contents stop meaning
those ids: new weights, a new slot geometry, a released cache; and when a stream's caller is gone
(a new session: a rollout continues only its own turns, so it computes the same after any other).
"""

from __future__ import annotations

from itertools import count


class SlotPrefixes:
    def __init__(self):
        self._held: dict[int, tuple[list[int], int]] = {}  # slot -> (ids held, shortest useful match)
        self._age: dict[int, int] = {}  # slot -> when recorded (the oldest is evicted first)
        self._clock = count()

    def clear(self) -> None:
        self._held.clear()
        self._age.clear()

    def __bool__(self) -> bool:
        return bool(self._held)

    def held_len(self, slot: int) -> int:
        return len(self._held[slot][0]) if slot in self._held else 0

    def record(self, slot: int, prompt_ids: list[int], generated: list[int]) -> None:
        """`slot` finished a request: it holds the prompt and all generated tokens but the last."""
        self._held[slot] = (list(prompt_ids) + generated[:-1], len(prompt_ids) + 1)
        self._age[slot] = next(self._clock)

    def take(self, slot: int) -> None:
        """`slot` goes to a request: what it held is being overwritten."""
        self._held.pop(slot, None)
        self._age.pop(slot, None)

    def match(self, prompt_ids: list[int], free: list[int]) -> tuple[int, int] | None:
        """(slot, positions to reuse): the free slot holding the longest continuation of
        `prompt_ids` (at least one token is left to prefill: its logits give the first sample);
        None when no free slot holds one."""
        best, best_len = None, 0
        for s in free:
            if s not in self._held:
                continue
            ids, shortest = self._held[s]
            n = min(len(ids), len(prompt_ids) - 1)
            if n >= shortest and ids[:n] == prompt_ids[:n] and n > best_len:
                best, best_len = s, n
        return None if best is None else (best, best_len)

    def spare(self, free: list[int], width: int) -> int:
        """The slot for a request that continues none: a free slot below `width` (any free slot
        if none is), empty first, then the one recorded longest ago.

        `width` is the decode batch the running and admitted requests need anyway; keeping
        unmatched requests below it keeps decode batches (and their graphs) as narrow as without
        this table, at the cost of prefixes no continuation claimed in time."""
        near = [s for s in free if s < width] or free
        empty = [s for s in near if s not in self._held]
        return empty[0] if empty else min(near, key=lambda s: self._age[s])
