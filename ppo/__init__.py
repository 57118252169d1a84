"""PPO algorithm, config, recipes, driver loop and data — independent of processes."""
