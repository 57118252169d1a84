"""rollout/* metrics of multi-turn trajectories (none for single-turn samples)."""

from __future__ import annotations

from ppo.generate.agents.session import AGENT_STATS
from ppo.generate.tool_loop import STATS


def trajectory_metrics(samples: list[dict]) -> dict[str, float]:
    """Turns per sample and the share of environment tokens in the responses; with the tool loop,
    its counts over the rollout: rollout/tool_calls, tool_errors, tool_timeouts, tool_time (s),
    tool_worker_restarts, and tool_errors/KIND for each error kind that happened; with agent
    sessions, theirs (ppo.generate.agents.session.AGENT_STATS)."""
    if not samples or "num_turns" not in samples[0]:
        return {}
    tokens = sum(len(s["response_ids"]) for s in samples)
    out = {"rollout/turns_per_sample": sum(s["num_turns"] for s in samples) / len(samples),
           "rollout/env_token_share": sum(s["num_env_tokens"] for s in samples) / max(tokens, 1)}
    if any(STATS[0] in s.get("stats", {}) for s in samples):
        names = {"tool_seconds": "tool_time"}
        kinds = sorted({k for s in samples for k in s.get("stats", {}) if k.startswith("tool_errors/")})
        for key in (*STATS, *kinds):
            out[f"rollout/{names.get(key, key)}"] = float(sum(s["stats"].get(key, 0) for s in samples))
    if any(AGENT_STATS[0] in s.get("stats", {}) for s in samples):  # agent sessions (docs/agents.md)
        for key in AGENT_STATS:
            out[f"rollout/{key}"] = float(sum(s["stats"].get(key, 0) for s in samples))
    return out
