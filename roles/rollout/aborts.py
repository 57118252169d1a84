"""Requests an engine gave up on, and issuing them again.

A backend that aborts requests (sglang's aborts; the built-in engine out of memory or with a
non-finite result) raises RequestsAborted naming the requests it hit and carrying the results
of the others. `generate_retrying` issues the hit requests again, each with its own seed (so
a request that succeeds on a later try yields the sample it would have yielded at first, where
the engine honours per-request seeds), at most `max_retries` times per request; one abort more
ends the call with RequestsGaveUp, one line naming the request (or, where the whole call was
aborted, all of its requests), its tries and the last reason.
"""

from __future__ import annotations

from typing import Callable

from roles.rollout.sampling import GenerateRequest


class RequestsAborted(Exception):
    """`ids`: the requests of one generate call the engine aborted; `results`: the others'."""

    def __init__(self, ids: list[int], reason: str, results: list[dict] = ()):
        reason = " ".join(str(reason).split())  # one line: sglang's messages may span several
        super().__init__(f"{len(ids)} requests aborted: {reason}")
        self.ids, self.reason, self.results = list(ids), reason, list(results)


class RequestsGaveUp(RuntimeError):
    """A request was aborted more often than the engine may issue it again."""


def generate_retrying(generate: Callable[[list[GenerateRequest], list[int]], list[dict]],
                      requests: list[GenerateRequest], seeds: list[int], *, max_retries: int,
                      where: str) -> list[dict]:
    """`generate(requests, seeds)`'s results in request order, each with "num_aborts": how
    often that request was aborted before this result."""
    if not requests:  # nothing to send: a backend is never asked for an empty batch
        return []
    by_id = {r.id: i for i, r in enumerate(requests)}
    results: list[dict | None] = [None] * len(requests)
    aborts = [0] * len(requests)
    pending = list(range(len(requests)))
    while pending:
        try:
            done, hit, reason = generate([requests[i] for i in pending], [seeds[i] for i in pending]), [], ""
        except RequestsAborted as e:
            done, hit, reason = e.results, [by_id[rid] for rid in e.ids], e.reason
        for result in done:
            results[by_id[result["id"]]] = result
        for i in hit:
            aborts[i] += 1
        over = [i for i in hit if aborts[i] > max_retries]
        if over:
            # an abort of the whole call (sglang raised; the built-in engine out of memory)
            # names no request of its own: say so rather than pick one
            who = (f"all {len(hit)} requests of the call were" if len(hit) == len(pending) > 1
                   else f"request id={requests[over[0]].id} was")
            times = max(aborts[i] for i in over)
            raise RequestsGaveUp(f"{where}: {who} aborted {times} times (the last: {reason}); a request is "
                                 f"issued again at most {max_retries} times (--rollout-max-request-retries)")
        pending = hit
    for result, n in zip(results, aborts):
        result["num_aborts"] = n
    return results
