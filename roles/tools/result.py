"""What one tool call gives back, whichever executor ran it, and how calls are counted.

Both executors (``roles.tools.executor.ToolExecutor``, the sandbox; ``roles.tools.in_process.
InProcessExecutor``) answer ``await call(name, arguments) -> ToolResult`` and never raise for
what a tool does; the tool loop (ppo.generate.tool_loop) adds its own ``malformed_call``
results for calls it cannot parse. ``count`` is the one place a result becomes counts: the
executors' cumulative ``stats()`` and each sample's ``stats`` (summed into ``rollout/tool_*``).
"""

from __future__ import annotations

from dataclasses import dataclass

# docs/tools.md says when each happens
ERROR_KINDS = ("malformed_call", "unknown_tool", "bad_arguments", "timeout", "memory", "process_limit",
               "output_limit", "network", "denied", "crash", "worker_lost")


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model reads: the tool's answer, or what went wrong
    ok: bool
    error_kind: str | None  # one of ERROR_KINDS when not ok
    seconds: float  # wall clock of the call, queueing for a worker included
    worker_restarts: int = 0  # tool workers replaced during the call (the sandbox's; it was run again)


def cut_result(text: str, full_chars: int, limit: int, seconds: float, worker_restarts: int = 0) -> ToolResult:
    """An answer of `full_chars` characters cut to its first `limit` (`text`): the model reads
    the part and a note; an `output_limit` error."""
    return ToolResult(text=f"{text}\n[output cut: {full_chars} characters, the limit is {limit}]", ok=False,
                      error_kind="output_limit", seconds=seconds, worker_restarts=worker_restarts)


def count(stats: dict, result: ToolResult) -> None:
    """Add one call to `stats`: tool_calls, tool_errors, tool_timeouts, tool_seconds (summed),
    tool_worker_restarts, and tool_errors/KIND for its error kind."""
    def add(key, value=1):
        stats[key] = stats.get(key, 0) + value

    add("tool_calls")
    add("tool_seconds", result.seconds)
    add("tool_worker_restarts", result.worker_restarts)
    if not result.ok:
        add("tool_errors")
        add(f"tool_errors/{result.error_kind}")
        add("tool_timeouts", result.error_kind == "timeout")


def new_counts() -> dict:
    """Every counter `count` touches, at zero."""
    return {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_seconds": 0.0, "tool_worker_restarts": 0,
            **{f"tool_errors/{kind}": 0 for kind in ERROR_KINDS}}
