"""Making a rollout batch: generation on the engines, rewards, dynamic sampling, the rollout one step ahead, evaluation."""
