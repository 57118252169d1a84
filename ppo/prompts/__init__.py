"""Prompt data: jsonl datasets served in resumable epochs, and tiny tasks generated on the spot."""
