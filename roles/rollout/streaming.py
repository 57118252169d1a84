"""The engine's side of streamed generation (RolloutEngine.stream): which caller's requests the
backend's running batch holds, and how often each was aborted.

A stream belongs to one session (the driver's rollout: ppo.generate.engines). A call of another
session means the earlier caller is gone (its rollout ended or failed), so its requests are
dropped rather than served to nobody. Aborts are handled as generate's (aborts.py): an aborted
request joins the running batch again with its seed, at most `max_retries` times.
"""

from __future__ import annotations

from dataclasses import dataclass

from roles.rollout.aborts import RequestsAborted, RequestsGaveUp
from roles.rollout.sampling import GenerateRequest


@dataclass
class _Streamed:
    request: GenerateRequest
    seed: int
    num_aborts: int = 0


class Streams:
    def __init__(self, backend, *, max_retries: int, where: str):
        self._backend, self._max_retries, self._where = backend, max_retries, where
        self.session: str | None = None
        self._held: dict[int, _Streamed] = {}  # request id -> the request, until its result went back

    def __len__(self) -> int:
        return len(self._held)

    def open(self, session: str) -> None:
        """Serve `session` from now on; another session's requests are dropped, and with them what
        the backend kept of earlier turns' K/V: a session's turns reuse only their own, so what a
        rollout computes does not depend on the rollouts before it (ppo.generate.engines' lockstep)."""
        self._held.clear()
        self._backend.drop_stream()
        self.session = session

    def drop(self) -> None:
        if self._held:
            self._backend.drop_stream()
        self._held.clear()

    def call(self, requests: list[GenerateRequest], seeds: list[int], wait_s: float | None) -> list[dict]:
        """The backend's `stream` for `requests` (new to the batch): results of finished requests,
        each with "num_aborts". Any error drops the whole stream (its batch is in no known state)."""
        twice = [r.id for r in requests if r.id in self._held]
        if twice:
            self.drop()
            raise ValueError(f"{self._where}: request id={twice[0]} is already streaming in session {self.session!r}; "
                             "ids must be unique within a session")
        for r, seed in zip(requests, seeds):
            self._held[r.id] = _Streamed(r, seed)
        results: list[dict] = []
        try:
            while True:
                try:
                    results += self._backend.stream(requests, seeds, wait_s)
                    break
                except RequestsAborted as e:
                    results += e.results
                    requests, seeds = self._again(e)
        except BaseException:
            self.drop()
            raise
        for result in results:
            result["num_aborts"] = self._held.pop(result["id"]).num_aborts
        return results

    def _again(self, e: RequestsAborted) -> tuple[list[GenerateRequest], list[int]]:
        again = [self._held[rid] for rid in e.ids]
        for s in again:
            s.num_aborts += 1
            if s.num_aborts > self._max_retries:
                raise RequestsGaveUp(f"{self._where}: request id={s.request.id} was aborted {s.num_aborts} times (the "
                                     f"last: {e.reason}); a request is issued again at most {self._max_retries} times "
                                     "(--rollout-max-request-retries)")
        return [s.request for s in again], [s.seed for s in again]
