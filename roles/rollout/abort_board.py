"""The abort board of a partial rollout: how the driver stops generate calls that are running.

An engine serves one call at a time (runtime.child), so an abort cannot arrive as a call while
`generate` runs. The board is a small shared file instead, mapped by the driver and by every
engine of the rollout (one node: the engines' processes and the driver share /dev/shm):

    byte 0          1 once the driver aborts the rollout
    byte 1 + id     1 once request `id` of the rollout finished (stop or length), written by
                    the engine that ran it; ids are the rollout's, 0 <= id < num_requests

The driver reads the finished flags to count complete groups while the calls run (a call's
results come back only when it returns), and sets byte 0 once enough are complete. An engine
reads byte 0 between decode steps; once set, it ends the call and returns every request: the
finished ones as usual, the others with finish_reason "abort" and the tokens they have so far
(sglang returns an aborted request the same way: `abort_request`, finish_reason
{"type": "abort"}, output so far). Single bytes: no torn writes, no locks.
"""

from __future__ import annotations

import mmap
import os
import tempfile

ABORTED = 0


class AbortBoard:
    def __init__(self, path: str, num_requests: int, mapping: mmap.mmap, owner: bool):
        self.path, self.num_requests = path, num_requests
        self._map, self._owner = mapping, owner

    @classmethod
    def create(cls, num_requests: int) -> AbortBoard:
        """The driver's board of a rollout of `num_requests` requests (all flags 0); close() removes it."""
        if num_requests < 1:
            raise ValueError(f"num_requests={num_requests} must be >= 1")
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="tandem-abort-", suffix=".board", dir=where)
        try:
            os.ftruncate(fd, 1 + num_requests)
            mapping = mmap.mmap(fd, 1 + num_requests)
        finally:
            os.close(fd)
        return cls(path, num_requests, mapping, owner=True)

    @classmethod
    def open(cls, path: str) -> AbortBoard:
        """An engine's view of the driver's board at `path`."""
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"abort_board={path!r} is not a board file (AbortBoard.create makes one)")
        with open(path, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), size)
        return cls(path, size - 1, mapping, owner=False)

    def abort(self) -> None:
        self._map[ABORTED] = 1

    def aborted(self) -> bool:
        return self._map[ABORTED] == 1

    def finish(self, request_id: int) -> None:
        if not 0 <= request_id < self.num_requests:
            raise ValueError(f"request id={request_id} is outside the board's [0, {self.num_requests})")
        self._map[1 + request_id] = 1

    def finished(self) -> bytes:
        """One byte per request id: 1 where it finished."""
        return self._map[1:1 + self.num_requests]

    def close(self) -> None:
        self._map.close()
        if self._owner:
            os.unlink(self.path)

    def __enter__(self) -> AbortBoard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
