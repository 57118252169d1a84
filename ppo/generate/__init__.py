"""Per-trajectory generation: the trajectory record, custom generate functions and the
built-in tool loop (docs/multi_turn.md)."""
