"""Role processes (rollout, trainer, reward): Actor subclasses with pluggable backends."""
