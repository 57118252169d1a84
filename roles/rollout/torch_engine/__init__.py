"""The built-in `torch` rollout backend: one entry point, `TorchBackend` (backend.py)."""

from roles.rollout.torch_engine.backend import TorchBackend

__all__ = ["TorchBackend"]
