"""Work from many trajectories, batched onto roles: turns onto the engines, finished samples
onto the reward scorers.

A `Batcher` keeps one queue per role. An idle role takes its whole queue as one call, so
requests of many trajectories share an engine's running batch, and a turn whose tool result
comes back while its engine is busy goes in that engine's next call. A role that dies mid-call
is replaced (`recover(handle, incarnation)`) and the same items are sent again; engine requests
carry their seeds, so nothing is counted twice and a re-issued turn is the one it would have
been. Each trajectory sticks to one engine (round robin by sample index), so that its turns
find their earlier tokens in that engine's KV cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ppo.generate.pump import Pump
from runtime import ActorDied, ActorHandle


class Batcher:
    """`await submit(i, item)`: the result of `item` from role i's `method(list of items)`, whose
    results come back in item order (RolloutEngine.generate, RewardScorer.score)."""

    def __init__(self, roles: list[ActorHandle], method: str, pump: Pump,
                 recover: Callable[[ActorHandle, int], None]):
        self.roles, self.method = roles, method
        self._pump, self._recover = pump, recover
        self._queues: list[list[tuple[dict, asyncio.Future]]] = [[] for _ in roles]
        self._wake = [asyncio.Event() for _ in roles]
        self.num_calls = 0  # calls issued, re-issues after a death included
        self.tasks = [asyncio.create_task(self._serve(i)) for i in range(len(roles))]  # one per role, until cancelled

    async def submit(self, i: int, item: dict):
        fut = asyncio.get_running_loop().create_future()
        self._queues[i].append((item, fut))
        self._wake[i].set()
        return await fut

    async def _serve(self, i: int) -> None:
        while True:
            await self._wake[i].wait()
            self._wake[i].clear()
            batch, self._queues[i] = self._queues[i], []
            if not batch:
                continue
            try:
                results = await self._call(i, [item for item, _ in batch])
            except Exception as e:  # a RemoteError: every trajectory that asked gets it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), result in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(result)

    async def _call(self, i: int, items: list[dict]) -> list:
        while True:
            try:
                self.num_calls += 1
                return await self._pump.watch(getattr(self.roles[i], self.method).call(items))
            except ActorDied as e:
                self._recover(self.roles[i], e.incarnation)



class EngineClient:
    """One turn at a time on the engines: `await generate(sample_index, prompt_ids, sampling)`."""

    def __init__(self, engines: list[ActorHandle], pump: Pump, recover: Callable[[ActorHandle, int], None]):
        self._batcher = Batcher(engines, "generate", pump, recover)
        self._next_id = 0

    @property
    def num_calls(self) -> int:
        return self._batcher.num_calls

    @property
    def tasks(self) -> list:
        return self._batcher.tasks

    async def generate(self, sample_index: int, prompt_ids: list[int], sampling: dict) -> dict:
        """The engine's result {"token_ids", "logprobs", "finish_reason", "weight_version"}."""
        request = {"id": self._next_id, "prompt_ids": list(prompt_ids), "sampling": dict(sampling)}
        self._next_id += 1
        return await self._batcher.submit(sample_index % len(self._batcher.roles), request)
