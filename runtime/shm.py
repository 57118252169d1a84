"""Shared-memory segments for large arrays between processes of one host.

Two ways in. ``SegmentPool.write`` copies an ordinary array into a segment (one memcpy,
the same as Ray's object store); ``shared_empty`` hands out an array that already lives
in a segment, and sending it (or any contiguous view of it, of any size) copies nothing:
only the segment's name, offset and a ticket travel. On this 2-vCPU VM one memcpy of 256 MiB takes 23 ms
whatever the thread count, so the second way is the only one that beats a copy.

Fresh memory is expensive: the kernel zeroes and faults in every page, which on a
busy host costs more than the copy itself. So each process keeps a pool of segments it
has already faulted in and reuses one once nobody needs it any more.

A segment is a /dev/shm file: one page of tickets, then the payload (page-aligned, so
any dtype's view is aligned). Each message that names a segment gets its own ticket,
a header byte the sender sets to 1. The receiver maps the file (once; it keeps the
mapping for later messages) and clears the ticket from a finalizer on the message's
array, which runs when the last view of it is freed. Only the
segment's owner hands out tickets, so no cross-process atomics are needed. A segment
is free again when its tickets are clear and no local array (``shared_empty``) views
it. A receiver that dies while holding a ticket leaves it set; that segment is then
never reused, and the supervisor removes every segment of the run at shutdown.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict

import numpy as np

SHM_DIR = "/dev/shm"
HEADER = mmap.PAGESIZE  # ticket bytes; the payload starts on the next page
TICKETS = HEADER
_NO_TICKETS = bytes(TICKETS)
MIN_SEGMENT = 1 << 20


class ShmError(ValueError):
    pass


def _round_up(n: int) -> int:
    size = MIN_SEGMENT
    while size < n + HEADER:
        size *= 2
    return size


class _Segment:
    __slots__ = ("name", "size", "mm", "start", "views", "_cursor", "_generation")

    def __init__(self, name: str, size: int, mm: mmap.mmap):
        self.name, self.size, self.mm = name, size, mm
        probe = np.frombuffer(mm, np.uint8, count=1)
        self.start = probe.ctypes.data  # the mapping's address, to recognise local views
        del probe  # an exported buffer would keep mm from closing
        self.views = 0  # live local arrays from shared_empty
        self._cursor = 0
        self._generation = 0

    def issue_ticket(self) -> tuple[int, int] | None:
        """A clear ticket byte, now set to a generation 1..255: (ticket, generation); None
        when all are out. release() clears a ticket only if it still holds its generation,
        so a late release cannot clear the same byte issued again since. (find scans in C.)"""
        t = self.mm.find(b"\x00", self._cursor, TICKETS)
        if t < 0:
            t = self.mm.find(b"\x00", 0, self._cursor)
            if t < 0:
                return None
        self._generation = self._generation % 255 + 1
        self.mm[t] = self._generation
        self._cursor = (t + 1) % TICKETS
        return t, self._generation

    def free(self) -> bool:
        return not self.views and self.mm[:TICKETS] == _NO_TICKETS


class SegmentPool:
    """The owning side: hands out faulted-in segments, reusing free ones.

    ``max_bytes`` bounds what the pool keeps: a segment that becomes free while the pool
    holds more is unmapped and removed instead of kept for reuse.
    """

    def __init__(self, prefix: str, max_bytes: int = 8 << 30):
        self.prefix, self.max_bytes = prefix, max_bytes
        self._segments: list[_Segment] = []
        self._lock = threading.RLock()  # finalizers (_unview) may run inside a locked section
        self.shared_views = 0  # live shared_empty arrays: senders look arrays up only if > 0

    @property
    def pooled_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def write(self, data: memoryview) -> tuple[str, int, int | None, int]:
        """Copy ``data`` into a segment; returns (name, offset, ticket, generation), the first
        three for the wire. A ticket of None marks a one-shot segment (beyond ``max_bytes``)
        that the receiver removes."""
        n = data.nbytes
        with self._lock:
            seg = self._take(n)
            pooled = True
            if seg is None:
                seg = self._create(_round_up(n))
                pooled = self.pooled_bytes + seg.size <= self.max_bytes
                if pooled:
                    self._segments.append(seg)
            ticket, generation = seg.issue_ticket() if pooled else (None, 0)
        seg.mm[HEADER:HEADER + n] = data
        if ticket is None:
            seg.mm.close()
        return seg.name, HEADER, ticket, generation

    def empty(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` living in a segment of this pool (contents undefined)."""
        with self._lock:
            seg = self._take(nbytes)
            if seg is None:
                seg = self._create(_round_up(nbytes))
                self._segments.append(seg)
            seg.views += 1
            self.shared_views += 1
        arr = np.frombuffer(seg.mm, np.uint8, count=nbytes, offset=HEADER)
        # Views of arr (slices, torch.from_numpy) keep arr alive, so this runs after the last.
        weakref.finalize(arr, self._unview, seg)
        return arr

    def _unview(self, seg: _Segment) -> None:
        with self._lock:
            seg.views -= 1
            self.shared_views -= 1

    def reference(self, arr: np.ndarray) -> tuple[str, int, int, int] | None:
        """Where a contiguous array lies if it is a view of a shared_empty segment of this
        pool: (name, offset, ticket, generation), with a fresh ticket; None if elsewhere."""
        ptr, n = arr.ctypes.data, arr.nbytes
        with self._lock:
            for seg in self._segments:
                if seg.views and seg.start + HEADER <= ptr and ptr + n <= seg.start + seg.size:
                    issued = seg.issue_ticket()
                    return None if issued is None else (seg.name, ptr - seg.start, *issued)
        return None

    def _take(self, n: int) -> _Segment | None:
        """A free pooled segment that fits ``n`` bytes without wasting more than half (lock held);
        free segments beyond max_bytes are dropped on the way."""
        found = None
        for seg in list(self._segments):
            if not seg.free():
                continue
            if found is None and n + HEADER <= seg.size <= 2 * _round_up(n):
                found = seg
            elif self.pooled_bytes > self.max_bytes:
                try:
                    seg.mm.close()
                except BufferError:
                    continue  # an array's finalizer ran before numpy let go of its buffer: keep it
                self._segments.remove(seg)
                unlink(seg.name)
        return found

    def _create(self, size: int) -> _Segment:
        name = f"{self.prefix}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # fallocate reserves the pages now: ENOSPC is an exception here, not a SIGBUS later
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return _Segment(name, size, mm)

    def release(self, name: str, ticket: int | None, generation: int) -> None:
        """Take back a ticket whose message will never be read (its receiver died)."""
        if ticket is None:
            unlink(name)
            return
        with self._lock:
            for s in self._segments:
                if s.name == name and s.mm[ticket] == generation:
                    s.mm[ticket] = 0

    def close(self) -> None:
        with self._lock:
            for s in self._segments:
                try:
                    s.mm.close()
                except BufferError:
                    pass  # a shared_empty array still views it: the mapping goes with the array
                unlink(s.name)
            self._segments.clear()


class SegmentReader:
    """The receiving side: maps each pooled segment once and clears a message's ticket when
    the last array viewing that message's bytes is freed.

    Mapping per message costs an open, fstat, mmap and munmap each time; so pooled
    segments stay mapped, least recently used first out, up to ``max_mapped_bytes``, and a
    mapping dropped from the cache lives on while arrays view it. An owner removes only
    free segments, which no valid message names, so a cached mapping needs no check per
    message; removed ones are let go at the next new mapping and all at ``clear()``, and
    until then the cache keeps their pages.
    """

    def __init__(self, prefix: str, max_mapped_bytes: int = 8 << 30):
        self.prefix, self.max_mapped_bytes = prefix, max_mapped_bytes
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, name: str, offset: int, nbytes: int, ticket: int | None) -> np.ndarray:
        """The message's bytes as a uint8 array; a view of it keeps the ticket held."""
        if not name.startswith(self.prefix + "-") or "/" in name:
            raise ShmError(f"shared-memory segment {name!r} does not belong to this run")
        path = os.path.join(SHM_DIR, name)
        mm = self._mapping(name, path) if ticket is not None else self._map_once(path)
        if not HEADER <= offset <= len(mm) - nbytes:
            raise ShmError(f"bytes {offset}..{offset + nbytes} are outside shared-memory segment "
                           f"{name!r} (payload {HEADER}..{len(mm)})")
        view = np.frombuffer(mm, np.uint8, count=nbytes, offset=offset)
        if ticket is not None:
            weakref.finalize(view, _clear_ticket, mm, ticket, os.getpid())
        return view

    def _mapping(self, name: str, path: str) -> mmap.mmap:
        with self._lock:
            mm = self._maps.get(name)
            if mm is not None:
                self._maps.move_to_end(name)
                return mm
        mm = self._map_once(path, unlink_after=False)
        with self._lock:
            # A new segment is when owners trim old ones: let go of those, so their pages go.
            for gone in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
                del self._maps[gone]
            self._maps[name] = mm
            while sum(len(m) for m in self._maps.values()) > self.max_mapped_bytes and len(self._maps) > 1:
                self._maps.popitem(last=False)
        return mm

    def clear(self) -> None:
        """Let go of every kept mapping (arrays still viewing one keep it alive)."""
        with self._lock:
            self._maps.clear()

    @staticmethod
    def _map_once(path: str, unlink_after: bool = True) -> mmap.mmap:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {os.path.basename(path)!r} is gone") from None
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
            if unlink_after:
                os.unlink(path)  # a one-shot segment: the mapping keeps its pages alive


def _clear_ticket(mm: mmap.mmap, ticket: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child dropping its inherited copy must not clear it
        try:
            mm[ticket] = 0
        except ValueError:
            pass  # the mapping was closed (the process is shutting down)


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_all(prefix: str) -> int:
    """Remove every segment of a run (the supervisor calls this at shutdown)."""
    n = 0
    for entry in os.scandir(SHM_DIR):
        if entry.name.startswith(prefix + "-"):
            unlink(entry.name)
            n += 1
    return n


# -- shared arrays -------------------------------------------------------------------------
# The pool of this process's runtime (the supervisor's in the driver, the role's in a role
# process), so that user code can allocate without holding a runtime object.
_process_pool: SegmentPool | None = None


def set_process_pool(pool: SegmentPool | None) -> None:
    global _process_pool
    _process_pool = pool


def clear_process_pool(pool: SegmentPool) -> None:
    global _process_pool
    if _process_pool is pool:
        _process_pool = None


def shared_empty(shape, dtype="float32"):
    """An uninitialised array in this process's shared memory; sending it copies nothing.

    ``dtype`` is a numpy dtype (returns a numpy array) or a torch dtype (returns a CPU
    tensor). The receiver gets a view of the same memory, as with torch.multiprocessing:
    do not write to the array while a receiver may still read it. Available in the
    driver while a Supervisor runs, and in every role process.
    """
    if _process_pool is None:
        raise RuntimeError("shared_empty needs this process's runtime with shared memory: call it "
                           "while a Supervisor(transport='ipc') runs, or inside an actor it spawned")
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape={shape!r}: dimensions must be non-negative ints")
    if type(dtype).__module__.startswith("torch"):
        import torch

        raw = _process_pool.empty(math.prod(shape) * dtype.itemsize)
        return torch.from_numpy(raw).view(dtype).view(shape)
    dt = np.dtype(dtype)
    return _process_pool.empty(math.prod(shape) * dt.itemsize).view(dt).reshape(shape)
