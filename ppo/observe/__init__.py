"""What a run reports: metrics.jsonl, the console, the event-built trace, tensorboard/wandb."""
