"""Starting a job: the run's processes from a config, generated models and data, the user's functions."""
