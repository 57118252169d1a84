"""Making a rollout batch: generation on the engines, one response per prompt or a trajectory
of many turns (custom generate functions, the built-in tool loop: docs/multi_turn.md; agents over the OpenAI
API in agents/: docs/agents.md), rewards,
dynamic sampling, the rollout one step ahead, evaluation."""
