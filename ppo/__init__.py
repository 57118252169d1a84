"""The PPO run: the driver loop (loop.py) and trainer recovery, over subpackages by concern:
config (dataclasses, validation, recipes, the command line), prompts, setup (starting a job's
processes), generate (making a rollout batch), gpu (placement and memory handoffs), state
(checkpoints, the run dir, signals) and observe (logs, console, trace); plus the command-line
tools evaluate, plot and make_model, and tiny_model (the tiny checkpoint tests and CPU runs build)."""
