"""A run's state on disk and its stops: checkpoints and their manifest, the run-dir claim, signals."""
