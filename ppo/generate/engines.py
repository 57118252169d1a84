"""Work from many trajectories onto roles: turns onto the engines, finished samples onto the
reward scorers.

Engines (`EngineClient`): each engine serves one stream (RolloutEngine.stream). The driver keeps
one call in flight per engine while any of its requests are out: each call carries the turns
queued since the last one, which join the engine's running batch at once, and returns the
requests that finished; the next call goes as soon as it returns. So a turn whose tool result
comes back while the engine decodes joins the batch within one call (a few decode syncs), and
continuous batching spans trajectories. Each trajectory sticks to one engine (round robin by
sample index), so that its turns find their earlier tokens in that engine's KV cache. With the
built-in engines the calls go in lockstep (`EngineClient`): a call waits until every running
trajectory of its engine has asked, so that a run repeats bit for bit.

Scorers (`Batcher`): an idle scorer takes its whole queue as one call.

A role that dies mid-call is replaced (`recover(handle, incarnation)`) and everything it had
not answered is sent again: engine requests carry their seeds, so a re-issued turn is the one
it would have been, and a result is taken once (nothing is counted twice).
"""

from __future__ import annotations

import asyncio
import uuid
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
    """One turn at a time on the engines: `await generate(sample_index, prompt_ids, sampling)`.

    lockstep (the built-in engine's): an engine's next call goes only once every trajectory that
    `expect` named for it and that is not `done` waits on it (a request queued or out), its new
    requests in (sample index, request id) order, and it decodes until one of its requests finishes,
    with no time limit (RolloutEngine.stream, wait_s None). So each call carries exactly the turns
    that followed the last call's results, and which requests decode together at every step
    depends on what the trajectories did, never on when: a run repeats bit for bit, and so does
    a run resumed from its checkpoint (on the CPU, where a request's log-probs move in their
    last bits with its batch-mates). The cost: the engine does not decode while a trajectory that
    got a result computes its next turn (runs its tools). Without lockstep a call goes as soon as
    the last returns, with whatever was queued meanwhile, and ends after at most STREAM_WAIT_S.
    """

    def __init__(self, engines: list[ActorHandle], pump: Pump, recover: Callable[[ActorHandle, int], None],
                 lockstep: bool):
        self.engines, self._pump, self._recover = engines, pump, recover
        self.lockstep = lockstep
        self._session = uuid.uuid4().hex  # the engines drop an earlier rollout's requests (roles/rollout/streaming.py)
        self._queues: list[list[tuple[int, dict, asyncio.Future]]] = [[] for _ in engines]  # (sample, request, future)
        self._wake = [asyncio.Event() for _ in engines]
        self._running: list[set[int]] = [set() for _ in engines]  # lockstep: the trajectories that may still ask
        self._asking: dict[int, int] = {}  # sample index -> its requests queued or out
        self._next_id = 0
        self.num_calls = 0  # stream calls issued, re-issues after a death included
        self.tasks = [asyncio.create_task(self._serve(i)) for i in range(len(engines))]  # one per engine, until cancelled

    def expect(self, sample_indices: list[int]) -> None:
        """Lockstep: these trajectories will ask for turns; no call goes while one of them computes."""
        for s in sample_indices:
            self._running[s % len(self.engines)].add(s)

    def done(self, sample_index: int) -> None:
        """Lockstep: this trajectory asks for no more turns."""
        i = sample_index % len(self.engines)
        self._running[i].discard(sample_index)
        self._wake[i].set()

    async def generate(self, sample_index: int, prompt_ids: list[int], sampling: dict) -> dict:
        """The engine's result {"token_ids", "logprobs", "finish_reason", "weight_version"}."""
        request = {"id": self._next_id, "prompt_ids": list(prompt_ids), "sampling": dict(sampling)}
        self._next_id += 1
        i = sample_index % len(self.engines)
        fut = asyncio.get_running_loop().create_future()
        self._queues[i].append((sample_index, request, fut))
        self._asking[sample_index] = self._asking.get(sample_index, 0) + 1
        self._wake[i].set()
        return await fut

    def _may_call(self, i: int, out: dict) -> bool:
        # a turn whose trajectory was stopped (a partial rollout's cut) is awaited by no one: not worth a call
        if all(fut.done() for _, _, fut in [*self._queues[i], *out.values()]):
            return False
        return not self.lockstep or all(self._asking.get(s, 0) for s in self._running[i])

    def _answer(self, sample_index: int, fut: asyncio.Future, result=None, error: Exception | None = None) -> None:
        self._asking[sample_index] -= 1  # its trajectory computes from here on
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    async def _serve(self, i: int) -> None:
        out: dict[int, tuple[int, dict, asyncio.Future]] = {}  # request id -> (sample, request, future): sent, not answered
        while True:
            while not self._may_call(i, out):
                await self._wake[i].wait()
                self._wake[i].clear()
            queued, self._queues[i] = self._queues[i], []
            new = [entry for entry in queued if not entry[2].done()]
            for sample, _, fut in queued:
                if fut.done():  # a queued turn is done only if cancelled: it is never sent
                    self._asking[sample] -= 1
            if self.lockstep:
                new.sort(key=lambda entry: (entry[0], entry[1]["id"]))  # not in the order their tools returned
            out.update((entry[1]["id"], entry) for entry in new)
            wait = {"wait_s": None} if self.lockstep else {}
            try:
                self.num_calls += 1
                results = await self._pump.watch(
                    self.engines[i].stream.call(self._session, [request for _, request, _ in new], **wait))
            except ActorDied as e:  # its replacement gets everything not answered, as new
                self._recover(self.engines[i], e.incarnation)
                self._queues[i][:0] = list(out.values())
                out.clear()
                continue
            except Exception as e:  # a RemoteError: the engine dropped its stream; every trajectory out gets it
                for sample, _, fut in out.values():
                    self._answer(sample, fut, error=e)
                out.clear()
                continue
            for result in results:
                sample, _, fut = out.pop(result["id"])
                self._answer(sample, fut, result)
