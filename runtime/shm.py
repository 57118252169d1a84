"""Shared-memory segments for large arrays between processes of one host.

Fresh memory is expensive: the kernel zeroes and faults in every page, which on a
busy host costs more than the copy itself. So each process keeps a pool of segments
it has already faulted in, and reuses one once the receiver is done with it.

A segment is a /dev/shm file: a 64-byte header, then the payload. Header byte 0 is
the in-use flag: the sender sets it before sending; the receiver maps the file (a new
mapping per message, so the mapping object's lifetime is exactly the lifetime of the
arrays that view it) and clears the flag from a finalizer when the last array viewing
it is freed. A receiver that dies while holding a segment leaves the flag set; the
segment is then never reused, and the supervisor removes every segment of the run at
shutdown.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
import weakref
from collections import OrderedDict

SHM_DIR = "/dev/shm"
HEADER = 64
MIN_SEGMENT = 1 << 20


class ShmError(ValueError):
    pass


def _round_up(n: int) -> int:
    size = MIN_SEGMENT
    while size < n + HEADER:
        size *= 2
    return size


class _Segment:
    __slots__ = ("name", "size", "mm")

    def __init__(self, name: str, size: int, mm: mmap.mmap):
        self.name, self.size, self.mm = name, size, mm

    def free(self) -> bool:
        return self.mm[0] == 0


class SegmentPool:
    """The sending side: hands out faulted-in segments, reusing freed ones."""

    def __init__(self, prefix: str, max_bytes: int = 8 << 30):
        self.prefix, self.max_bytes = prefix, max_bytes
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()

    @property
    def pooled_bytes(self) -> int:
        return sum(s.size for s in self._segments)

    def write(self, data: memoryview) -> tuple[str, bool]:
        """Copy ``data`` into a free segment (or a new one); returns (name, pooled)."""
        n = data.nbytes
        with self._lock:
            seg = next((s for s in self._segments
                        if n + HEADER <= s.size <= 2 * _round_up(n) and s.free()), None)
            pooled = True
            if seg is None:
                seg = self._create(_round_up(n))
                pooled = self.pooled_bytes + seg.size <= self.max_bytes
                if pooled:
                    self._segments.append(seg)
            seg.mm[0] = 1
        seg.mm[HEADER:HEADER + n] = data
        if not pooled:
            seg.mm.close()
        return seg.name, pooled

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

    def release(self, name: str, pooled: bool) -> None:
        """Take back a segment whose message will never be read (its receiver died)."""
        if not pooled:
            unlink(name)
            return
        with self._lock:
            for s in self._segments:
                if s.name == name:
                    s.mm[0] = 0

    def close(self) -> None:
        with self._lock:
            for s in self._segments:
                s.mm.close()
                unlink(s.name)
            self._segments.clear()


class SegmentReader:
    """The receiving side: maps segments and clears their flag when the arrays are gone."""

    def __init__(self, prefix: str, max_headers: int = 1024):
        self.prefix = prefix
        self._headers: OrderedDict[str, mmap.mmap] = OrderedDict()  # first page of each segment
        self._lock = threading.Lock()
        self._max_headers = max_headers

    def read(self, name: str, nbytes: int, pooled: bool) -> memoryview:
        if not name.startswith(self.prefix + "-") or "/" in name:
            raise ShmError(f"shared-memory segment {name!r} does not belong to this run")
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ShmError(f"shared-memory segment {name!r} is gone") from None
        try:
            size = os.fstat(fd).st_size
            if nbytes + HEADER > size:
                raise ShmError(f"shared-memory segment {name!r} holds {size - HEADER} bytes, "
                               f"header says {nbytes}")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            if pooled:
                weakref.finalize(mm, _clear_flag, self._header(name, fd))
        finally:
            os.close(fd)
            if not pooled:
                os.unlink(path)  # a one-shot segment: the mapping keeps its pages alive
        return memoryview(mm)[HEADER:HEADER + nbytes]

    def _header(self, name: str, fd: int) -> mmap.mmap:
        with self._lock:
            hdr = self._headers.get(name)
            if hdr is None:
                hdr = self._headers[name] = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
                if len(self._headers) > self._max_headers:
                    self._headers.popitem(last=False)[1].close()
            self._headers.move_to_end(name)
            return hdr


def _clear_flag(header: mmap.mmap) -> None:
    try:
        header[0] = 0
    except ValueError:
        pass  # evicted from the cache: the segment stays marked busy and is never reused


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
