"""``InProcessExecutor``: tool calls in the rollout's own process, for trusted plain-Python tools
(a calculator) where a sandbox per call would cost more than the call (``--no-tool-sandbox``;
docs/tools.md compares the two).

The same contract as the sandbox's ``ToolExecutor``: ``await call(name, arguments) ->
ToolResult``, never an exception for what the tool does; the same checks of the arguments
against the specs, the same wall-clock timeout (``--tool-timeout``), output cut and error
kinds. None of the isolation: no CPU, memory, process or file limits, and the tool sees the
driver's files, network and memory. A sync function runs in a thread of the executor's own
(``--num-tool-workers`` of them), so a hanging call costs its thread until it returns, not the
event loop; an ``async def`` tool runs on the rollout's event loop and must not block it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from roles.reward.custom import describe
from roles.tools.result import ToolResult, count, cut_result, new_counts
from roles.tools.runner import error_kind
from roles.tools.sandbox import Limits
from roles.tools.specs import ToolSet, load_tool_function


class InProcessExecutor:
    sandboxed = False

    def __init__(self, tools: ToolSet, limits: Limits, *, num_workers: int):
        self._tools, self._limits = tools, limits
        self._function = load_tool_function(tools.function_path)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="tool-call")
        self._lock = threading.Lock()
        self._counts = new_counts()

    async def call(self, name: str, arguments: dict) -> ToolResult:
        start = time.monotonic()
        problem = self._tools.argument_problem(name, arguments)
        if problem is not None:
            kind, text = problem
            return self._count(ToolResult(text=f"error: {text}", ok=False, error_kind=kind, seconds=0.0))
        result = await self._run(name, arguments)
        return self._count(result if isinstance(result, ToolResult) else self._answer(result, start))

    def stats(self) -> dict:
        """Counters since start, as ``ToolExecutor.stats()``."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)  # a hung call's thread ends with the process

    async def _run(self, name: str, arguments: dict) -> object:
        start, timeout = time.monotonic(), self._limits.timeout_s
        try:
            if inspect.iscoroutinefunction(self._function):
                return await asyncio.wait_for(self._function(name, arguments), timeout)
            call = asyncio.get_running_loop().run_in_executor(self._threads, self._function, name, arguments)
            return await asyncio.wait_for(call, timeout)
        except TimeoutError:
            return ToolResult(text=f"error: the tool ran longer than {timeout:g} s and was stopped", ok=False,
                              error_kind="timeout", seconds=time.monotonic() - start)
        except Exception as e:  # the tool's failure is the model's to read, never the run's
            return ToolResult(text=f"error: {describe(e)}", ok=False, error_kind=error_kind(e),
                              seconds=time.monotonic() - start)

    def _answer(self, text: object, start: float) -> ToolResult:
        seconds, limit = time.monotonic() - start, self._limits.max_output_chars
        if not isinstance(text, str):
            return ToolResult(text=f"error: the tool function returned a {type(text).__name__}, not a str", ok=False,
                              error_kind="crash", seconds=seconds)
        if len(text) > limit:
            return cut_result(text[:limit], len(text), limit, seconds)
        return ToolResult(text=text, ok=True, error_kind=None, seconds=seconds)

    def _count(self, result: ToolResult) -> ToolResult:
        with self._lock:
            count(self._counts, result)
        return result
