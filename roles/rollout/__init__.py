"""Rollout engine role: batched generation with log-probs, memory release/resume, weight updates."""

from roles.rollout.config import EngineConfig
from roles.rollout.engine import RolloutEngine

__all__ = ["EngineConfig", "RolloutEngine"]
