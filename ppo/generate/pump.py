"""Await runtime futures from asyncio code, on the driver's one thread.

The runtime's futures are read by pumping the caller's sockets (runtime.handle), which is not
thread-safe, so the pump runs as one task of the event loop: it waits a few milliseconds on
the futures in flight, resolves the asyncio futures of those done, and yields so that the
trajectories (and tool calls run in threads) move on meanwhile.
"""

from __future__ import annotations

import asyncio

from runtime import wait_any

POLL_S = 0.005  # longest the event loop is held waiting on the engines; tool results wait at most this


class Pump:
    def __init__(self):
        self._watched: dict[object, asyncio.Future] = {}

    def watch(self, call) -> asyncio.Future:
        """An asyncio future resolved with the runtime future's value or error."""
        fut = asyncio.get_running_loop().create_future()
        self._watched[call] = fut
        return fut

    async def run(self) -> None:
        """Until cancelled: resolve whatever the runtime delivered."""
        while True:
            if not self._watched:
                await asyncio.sleep(POLL_S / 5)
                continue
            for call in wait_any(list(self._watched), timeout=POLL_S):
                fut = self._watched.pop(call)
                if fut.cancelled():
                    continue
                try:
                    fut.set_result(call.result())
                except BaseException as e:  # ActorDied, RemoteError: the awaiting coroutine decides
                    fut.set_exception(e)
            await asyncio.sleep(0)
