"""ToolExecutor's supervision where a worker cannot be replaced (roles/tools/executor.py _run,
_replace): the call is answered ``worker_lost`` and counted, never raised, and the next call
starts the replacement. Runs with or without bwrap: the workers are what is tested."""

import asyncio
import os
import signal

import pytest

from roles.tools.executor import ToolExecutor
from roles.tools.sandbox import Limits
from roles.tools.specs import load_tools

LIMITS = Limits(timeout_s=5.0, cpu_seconds=2, memory_bytes=256 << 20, max_processes=16, max_file_bytes=1 << 20,
                max_output_chars=100)


@pytest.mark.timeout(60)
def test_a_replacement_that_does_not_start_answers_worker_lost_and_the_next_call_replaces_it():
    tools = load_tools("roles.tools.calculator:TOOL_SPECS", "roles.tools.calculator:execute_tool")
    ex = ToolExecutor(tools, LIMITS, num_workers=1)
    try:
        setup = ex._setup
        # a setup the worker cannot read (roles/tools/worker.py main: Limits(**setup["limits"])): it dies starting
        ex._setup = {**setup, "limits": {}}
        os.kill(ex._workers[0].process.pid, signal.SIGKILL)
        r = asyncio.run(ex.call("calculator", {"expression": "6*7"}))
        assert (r.ok, r.error_kind) == (False, "worker_lost"), r
        assert "its replacement did not start" in r.text
        stats = ex.stats()
        assert (stats["tool_calls"], stats["tool_errors/worker_lost"], stats["tool_worker_restarts"]) == (1, 1, 1)
        ex._setup = setup
        assert asyncio.run(ex.call("calculator", {"expression": "6*7"})).text == "42"
        assert ex.stats()["tool_calls"] == 2 and ex.stats()["tool_worker_restarts"] == 2
    finally:
        ex.close()
