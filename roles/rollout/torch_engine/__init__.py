"""The built-in `torch` rollout backend: one entry point, `TorchBackend` (backend.py)."""

from roles.rollout.torch_engine.backend import MEMORY_TAGS, TorchBackend

__all__ = ["MEMORY_TAGS", "TorchBackend"]
