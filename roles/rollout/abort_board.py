"""The abort board of a partial rollout: how the driver stops generate calls that are running.

An engine serves one call at a time (runtime.child), so an abort cannot arrive as a call while
`generate` runs. The board is a small shared file instead, mapped by the driver and by every
engine of the rollout (one node: the engines' processes and the driver share /dev/shm). It is
an array of int32 (aligned: no torn writes, no locks):

    header        aborted (1 once the rollout is aborted), lockstep (0/1), need (complete groups
                  that end the rollout), abort_sync (the sync the lockstep abort falls after; -1
                  until known), num_requests, num_chunks
    group[id]     the group of request `id` (ids are the rollout's, 0 <= id < num_requests)
    chunk[id]     the call (engine) that runs it
    finished[id]  0 while running; once it finished (stop or length): 1, or under lockstep the
                  sync of its engine's call it finished in (1, 2, ...)
    progress[k]   under lockstep: the syncs call k has completed

An engine reads the board once per sync of its call (`aborted()`: the built-in engine's
scheduler, every decode step on the CPU, every `sync_every` on a GPU); once aborted it ends the
call and returns every request: the finished ones as usual, the others with finish_reason
"abort" and the tokens they have so far (sglang returns an aborted request the same way).

Who decides the abort:
- driver (lockstep 0): the driver counts complete groups from the finished flags while the calls
  run and sets `aborted` once `need` are complete. Where the abort lands depends on timing.
- lockstep (1; the built-in engine): the engines decide, in a clock of syncs that every call
  shares. At its sync c a call publishes that it completed c - 1 syncs, waits until every other
  call completed c - 1 (or finished all its requests), and counts the groups complete by sync
  c - 1: at `need` or more the abort falls after sync c - 1 for every call. Each call's syncs
  depend only on its requests, so the abort lands on the same tokens in every run: a partial
  run, and a run resumed from its checkpoint, repeat bit for bit. A call issued again (its
  engine died) replays its syncs up to the abort. The cost: a call runs at most one sync ahead
  of the slowest. The driver's own `abort()` (a failed rollout) still ends every call at once.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

import numpy as np

ABORTED, LOCKSTEP, NEED, ABORT_SYNC, NUM_REQUESTS, NUM_CHUNKS = range(6)
HEADER = 6
# a lockstep call waiting at a sync looks for the others after WAIT_S, then ever less often (an
# engine being replaced takes seconds) up to MAX_WAIT_S
WAIT_S, MAX_WAIT_S = 0.0002, 0.005
NO_LIMIT = 2**31 - 1  # `need` of a rollout that runs every request to its end


class AbortBoard:
    def __init__(self, path: str, mapping: mmap.mmap, owner: bool):
        self.path, self._map, self._owner = path, mapping, owner
        self._ints = np.frombuffer(mapping, dtype=np.int32)
        n, k = int(self._ints[NUM_REQUESTS]), int(self._ints[NUM_CHUNKS])
        self.num_requests, self.num_chunks = n, k
        self._group = self._ints[HEADER:HEADER + n]
        self._chunk = self._ints[HEADER + n:HEADER + 2 * n]
        self._finished = self._ints[HEADER + 2 * n:HEADER + 3 * n]
        self._progress = self._ints[HEADER + 3 * n:HEADER + 3 * n + k]
        self._num_groups = len(np.unique(self._group))
        self._mine: int | None = None  # an engine's chunk (join)
        self._syncs = 0  # an engine's syncs so far in this call

    @classmethod
    def create(cls, groups: list[int], chunks: list[int], need: int | None, lockstep: bool) -> AbortBoard:
        """The driver's board of a rollout whose request `id` is of group `groups[id]` and runs in
        call `chunks[id]`; it ends once `need` groups (of those with requests) are complete (None:
        never). close() removes it."""
        n = len(groups)
        if n < 1 or len(chunks) != n:
            raise ValueError(f"a board needs >= 1 request and a chunk per request; got {n} groups, {len(chunks)} chunks")
        k = max(chunks) + 1
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="tandem-abort-", suffix=".board", dir=where)
        try:
            size = 4 * (HEADER + 3 * n + k)
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        ints = np.frombuffer(mapping, dtype=np.int32)
        ints[:HEADER] = [0, int(lockstep), NO_LIMIT if need is None else need, -1, n, k]
        ints[HEADER:HEADER + n] = groups
        ints[HEADER + n:HEADER + 2 * n] = chunks
        del ints  # no view may outlive the mapping's close
        return cls(path, mapping, owner=True)

    @classmethod
    def open(cls, path: str, request_ids: list[int]) -> AbortBoard:
        """An engine's view of the driver's board at `path`, for a call of `request_ids`."""
        if not isinstance(path, str) or not os.path.isfile(path):
            raise ValueError(f"abort_board={path!r} is not a board file (AbortBoard.create makes one)")
        with open(path, "r+b") as f:
            mapping = mmap.mmap(f.fileno(), os.fstat(f.fileno()).st_size)
        board = cls(path, mapping, owner=False)
        bad = [i for i in request_ids if not 0 <= i < board.num_requests]
        if bad:
            board.close()
            raise ValueError(f"with an abort board, request ids are its slots 0..{board.num_requests - 1}; "
                             f"got ids {sorted(bad)[:4]}...")
        chunks = {int(board._chunk[i]) for i in request_ids}
        if len(chunks) > 1:
            board.close()
            raise ValueError(f"request ids {sorted(request_ids)[:4]}... belong to calls {sorted(chunks)} of the board; "
                             "one call runs one chunk")
        board._mine = chunks.pop() if chunks else None
        return board

    # -- the driver ----------------------------------------------------------------------
    def abort(self) -> None:
        self._ints[ABORTED] = 1

    def complete_groups(self, by_sync: int | None = None) -> int:
        """Groups (of those with requests) whose every request finished (by sync `by_sync`)."""
        done = self._finished >= 1 if by_sync is None else (self._finished >= 1) & (self._finished <= by_sync)
        return self._num_groups - len(np.unique(self._group[~done]))

    def check(self) -> None:
        """The driver's decision (lockstep 0): abort once `need` groups are complete."""
        if not self._ints[LOCKSTEP] and not self._ints[ABORTED] and self.complete_groups() >= self._ints[NEED]:
            self.abort()

    def finished(self) -> np.ndarray:
        """Per request id: finished (bool)."""
        return self._finished >= 1

    @property
    def abort_sync(self) -> int | None:
        """Under lockstep, the sync the abort fell after (None: not yet)."""
        return None if self._ints[ABORT_SYNC] < 0 else int(self._ints[ABORT_SYNC])

    # -- an engine's call ------------------------------------------------------------------
    def aborted(self) -> bool:
        """Read once per sync by the call running: True when it must end now (module docstring)."""
        self._syncs += 1
        if not self._ints[LOCKSTEP] or self._mine is None:
            return bool(self._ints[ABORTED])
        done = self._syncs - 1
        self._progress[self._mine] = done
        wait = WAIT_S
        while True:
            at = int(self._ints[ABORT_SYNC])
            if at >= 0:
                return self._syncs > at
            if self._ints[ABORTED]:  # the driver's own abort
                return True
            if all(self._progress[k] >= done or self._chunk_done(k) for k in range(self.num_chunks) if k != self._mine):
                break
            time.sleep(wait)
            wait = min(2 * wait, MAX_WAIT_S)
        if self.complete_groups(by_sync=done) >= self._ints[NEED]:
            self._ints[ABORT_SYNC] = done  # every call that counts here counts the same
            self._ints[ABORTED] = 1
            return True
        return False

    def _chunk_done(self, k: int) -> bool:
        return bool(np.all(self._finished[self._chunk == k] >= 1))

    def finish(self, request_id: int) -> None:
        """Request `request_id` finished (stop or length) in the current sync."""
        if not 0 <= request_id < self.num_requests:
            raise ValueError(f"request id={request_id} is outside the board's [0, {self.num_requests})")
        self._finished[request_id] = max(self._syncs, 1) if self._ints[LOCKSTEP] else 1

    def close(self) -> None:
        del self._ints, self._group, self._chunk, self._finished, self._progress
        self._map.close()
        if self._owner:
            os.unlink(self.path)

    def __enter__(self) -> AbortBoard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
