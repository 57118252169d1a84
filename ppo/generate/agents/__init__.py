"""Agents written against the OpenAI chat API, trained as they are: the session server and agent functions (docs/agents.md)."""
