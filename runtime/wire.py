"""The wire format: a msgpack header followed by raw frames.

A message is ``[header, frame0, frame1, ...]``. The header is a msgpack map
``{kind, id, src, dst, method, inc, deadline, token, bufs, body}`` where ``body``
is the msgpack-encoded payload in which every array is an ext reference to an
entry of ``bufs = [(lib, dtype, shape, where)]``; ``where`` is a frame index, or
``[segment name, offset, ticket]`` for arrays in shared memory between processes of
one host: large ones, and views of ``shared_empty`` arrays (see runtime.shm), or the
array's bytes themselves for small arrays (up to ``inline_max_bytes``): one message part
instead of two (no zmq.Frame per array on either side; a few microseconds per small array
on the 2-core box: docs/journal/, "Calls with small arguments").
Arrays never pass through msgpack's object model or pickle: frames are sent
``copy=False`` from 64 KiB and decoded as zero-copy views; inline bytes are copied once
into a writable buffer, as received frames are writable.

Array types are plugged in through a small codec registry so this module never
imports torch: numpy is built in, torch tensors are recognised by their type's
module and converted only when one is actually sent.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np

from runtime import shm

ZERO_COPY_MIN_BYTES = 64 * 1024
EXT_ARRAY = 1
EXT_CODEC = 2  # registered object codecs (actor handles, ...)
# Each nested object codec costs a recursive msgpack.unpackb whose C unpacker keeps its
# parse stack on the C stack: 3,000 nested EXT_CODECs in a message of a few tens of KB
# overflowed it and killed the process (segfault) before Python's recursion limit could
# raise. Real codec states (actor handles) nest one or two levels.
MAX_CODEC_DEPTH = 16
# numpy's NPY_MAXDIMS; bounding the rank (and each dim below) keeps math.prod(shape) cheap:
# a 0.9 MB header listing 100k dims of 2**62 made it a 36 s big-int product.
MAX_DIMS = 64
MAX_DIM = (1 << 63) - 1

HEADER_KEYS = ("kind", "id", "src", "dst", "method", "inc", "deadline", "token", "bufs", "body")


class WireError(ValueError):
    """A message that cannot be decoded: garbage, truncated, oversized, or lying about its sizes."""

    def __init__(self, message: str):
        # Messages quote what arrived, and actors publish them as `rejected` events: a header
        # with a 100k-entry shape made a 2 MB event. Keep the start, which names the problem.
        if len(message) > 400:
            message = message[:400] + f"... ({len(message) - 400} more characters)"
        super().__init__(message)


# --- array codecs -----------------------------------------------------------------

_dtype_names: dict[np.dtype, str] = {}  # dtype.name is a slow Python property


def _numpy_dtype_name(arr: np.ndarray) -> str:
    name = _dtype_names.get(arr.dtype)
    if name is None:
        if arr.dtype.hasobject or arr.dtype.kind in "OUSVMm":
            raise TypeError(f"numpy arrays of dtype {arr.dtype} cannot be sent: only numeric and bool dtypes "
                            "travel as frames")
        name = _dtype_names[arr.dtype] = arr.dtype.name
    return name


def _torch_to_numpy(t) -> tuple[str, np.ndarray]:
    """Return (torch dtype name, a numpy view of the bytes). Copies only when not contiguous."""
    import torch

    if t.device.type != "cpu":
        raise TypeError(f"a {t.device.type} tensor cannot be sent on the wire; move it to the CPU first "
                        "(GPU-to-GPU transfers use CUDA IPC handles, not frames)")
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if t.dtype in (torch.bfloat16, torch.float16):
        view = t.view(torch.int16).numpy()
    elif t.element_size() == 1 and t.dtype not in (torch.uint8, torch.int8, torch.bool):
        view = t.view(torch.uint8).numpy()  # float8 variants
    else:
        view = t.numpy()
    return name, view


def _is_torch_tensor(obj) -> bool:
    t = type(obj)
    return t.__module__.startswith("torch") and t.__name__ in ("Tensor", "Parameter")


@dataclass(frozen=True)
class ObjectCodec:
    """How a non-array object (e.g. an actor handle) travels: as a msgpack-able state."""

    tag: str
    cls: type
    to_state: Callable[[Any], Any]
    from_state: Callable[[Any, Any], Any]  # (state, receiving context) -> object


_object_codecs: dict[str, ObjectCodec] = {}
_codec_of_type: dict[type, ObjectCodec] = {}  # exact classes first: a subclass has its own codec


def register_object_codec(codec: ObjectCodec) -> None:
    _object_codecs[codec.tag] = codec
    _codec_of_type[codec.cls] = codec


def register_config(cls: type) -> type:
    """Let instances of the config dataclass `cls` travel as themselves: sent as their fields,
    built again on arrival, so a role receives its typed config (and its __post_init__ checks
    it once more). Tuple fields arrive as tuples (msgpack has only lists). The receiving
    process must have registered `cls` too: the role's module does, and a role's class is
    imported before its arguments are decoded. Returns `cls` (usable as a decorator)."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"register_config({cls!r}): not a dataclass")

    @functools.cache
    def tuple_fields() -> frozenset[str]:  # resolved at first use: the module has finished loading
        hints = typing.get_type_hints(cls)
        return frozenset(f.name for f in dataclasses.fields(cls)
                         if hints[f.name] is tuple or typing.get_origin(hints[f.name]) is tuple)

    def to_state(obj) -> dict:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}

    def from_state(state: dict, _context) -> Any:
        tuples = tuple_fields()
        return cls(**{k: tuple(v) if k in tuples and isinstance(v, list) else v for k, v in state.items()})

    register_object_codec(ObjectCodec(f"config:{cls.__module__}.{cls.__qualname__}", cls, to_state, from_state))
    return cls


# --- encode / decode ------------------------------------------------------------------

@dataclass
class WireConfig:
    """Limits and transport choices shared by every socket of a run."""

    token: str
    max_message_bytes: int = 16 << 30
    shm_prefix: str | None = None  # None: no shared memory (e.g. across hosts)
    shm_min_bytes: int = 1 << 20
    # Arrays up to this size travel inside the header (see the module doc); the header's
    # cap (max_header_bytes) still holds: past half of it, arrays go as frames again.
    inline_max_bytes: int = 8 << 10
    # How long callers poll for a reply, and actors for the next call, before they sleep
    # (handle.Caller._spin, child._Child._serve): a ZeroMQ round trip crosses six threads, and
    # waking them across vCPUs is most of its time (python -m bench.transport_floor).
    spin_us: int = 500
    # Across nodes (runtime.agent): the job's runtime.curve.KeyPair. Every tcp socket is then a
    # CURVE server or client with it, and only holders of its secret key get through.
    curve: Any = None
    _pool: shm.SegmentPool | None = field(default=None, repr=False)
    _reader: shm.SegmentReader | None = field(default=None, repr=False)

    @property
    def max_header_bytes(self) -> int:
        """Decoding msgpack can cost up to ~80 bytes of Python objects per byte received (an
        array of empty maps), so the msgpack part is capped at 1/128 of max_message_bytes:
        decoding any message then allocates less than max_message_bytes. Arrays, the bulk
        of any large message, travel as frames and are not decoded into objects. The default
        (16 GiB / 128 = 128 MiB) fits an engine's reply of 512 responses of 8192 tokens with
        their log-probs as lists (~60 MB of msgpack)."""
        return self.max_message_bytes // 128

    def __post_init__(self):
        if self.shm_prefix is not None:
            self._pool = shm.SegmentPool(self.shm_prefix)
            self._reader = shm.SegmentReader(self.shm_prefix)

    def release(self, segments: list) -> None:
        """Take back the shared-memory tickets of a message that will never be read."""
        for name, ticket, generation in segments:
            self._pool.release(name, ticket, generation)


@dataclass
class Encoded:
    frames: list  # [header bytes, buffers...]
    segments: list = field(default_factory=list)  # [(shm name, ticket, generation)]

    @property
    def zero_copy(self) -> bool:
        """Send with copy=False only when a frame is big: zmq.Frame objects cost more than
        copying a small message."""
        return any(f.nbytes >= ZERO_COPY_MIN_BYTES for f in self.frames[1:])


def encode(cfg: WireConfig, header: dict, body: Any) -> Encoded:
    """Encode header fields and a payload. Raises TypeError naming any unsendable type."""
    enc = _Encoder(cfg)
    try:
        packed_body = msgpack.packb(body, default=enc, use_bin_type=True)
        head = msgpack.packb(dict(header, token=cfg.token, bufs=enc.bufs, body=packed_body),
                             use_bin_type=True)
    except BaseException:
        if enc.segments:
            cfg.release(enc.segments)
        raise
    return Encoded([head, *enc.frames], enc.segments)


class _Encoder:
    """msgpack ``default`` hook collecting arrays into frames (a class: see _ExtDecoder)."""

    def __init__(self, cfg: WireConfig):
        self.cfg = cfg
        self.bufs: list[list] = []
        self.frames: list = []
        self.segments: list = []
        self.inline_bytes = 0
        self.inline_budget = cfg.max_header_bytes // 2

    def add_array(self, lib: str, dtype: str, arr: np.ndarray) -> msgpack.ExtType:
        flat = np.ascontiguousarray(arr)  # (1-d for a 0-d arr: the spec keeps arr.shape)
        data = memoryview(flat).cast("B") if arr.size else memoryview(b"")
        pool = self.cfg._pool
        # A view of a shared_empty array, of any size, travels as a reference; other arrays
        # from shm_min_bytes up are copied once into a segment, smaller ones go as frames.
        placed = pool.reference(flat) if pool is not None and pool.shared_views else None
        if placed is None and pool is not None and data.nbytes >= self.cfg.shm_min_bytes:
            placed = pool.write(data)
        if placed is not None:
            name, offset, ticket, generation = placed
            self.segments.append((name, ticket, generation))
            where: Any = [name, offset, ticket]
        elif data.nbytes <= self.cfg.inline_max_bytes and self.inline_bytes + data.nbytes <= self.inline_budget:
            self.inline_bytes += data.nbytes
            where = data.tobytes()
        else:
            where = len(self.frames) + 1
            self.frames.append(data)
        self.bufs.append([lib, dtype, list(arr.shape), where, data.nbytes])
        return msgpack.ExtType(EXT_ARRAY, _pack_index(len(self.bufs) - 1))

    def __call__(self, obj):
        if isinstance(obj, np.ndarray):
            return self.add_array("numpy", _numpy_dtype_name(obj), obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if _is_torch_tensor(obj):
            dtype, view = _torch_to_numpy(obj)
            return self.add_array("torch", dtype, view)
        codec = _codec_of_type.get(type(obj)) or next(
            (c for c in _object_codecs.values() if isinstance(obj, c.cls)), None)
        if codec is not None:
            return msgpack.ExtType(EXT_CODEC, msgpack.packb([codec.tag, codec.to_state(obj)], default=self))
        raise TypeError(
            f"cannot send an object of type {type(obj).__module__}.{type(obj).__qualname__}: "
            "payloads may hold dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays, "
            "CPU torch tensors, actor handles and registered configs (register_config); convert it "
            "(e.g. dataclasses.asdict) first")


def _pack_index(i: int) -> bytes:
    """msgpack of the non-negative int `i`, written by hand: a msgpack.packb nested in the
    packer's `default` hook costs about 15 us (it sets up a second packer), three times
    the rest of a small array's encoding and most of what made a call with a 4-element
    array slower than one with a small dict."""
    return bytes((i,)) if i < 128 else b"\xce" + i.to_bytes(4, "big")  # positive fixint, or uint 32


def decode_header(cfg: WireConfig, frames: list) -> dict:
    """Parse and validate the header; the body stays packed until decode_body."""
    if not frames:
        raise WireError("empty message")
    # nbytes, not len: len() of a memoryview counts items, under-counting wide formats.
    total = sum(_buf(f).nbytes for f in frames)
    if total > cfg.max_message_bytes:
        raise WireError(f"message of {total} bytes exceeds max_message_bytes={cfg.max_message_bytes}")
    head = _buf(frames[0]).nbytes
    if head > cfg.max_header_bytes:
        raise WireError(f"header of {head} bytes exceeds max_header_bytes={cfg.max_header_bytes} "
                        "(max_message_bytes / 128; send large payloads as arrays)")
    try:
        hdr = msgpack.unpackb(_buf(frames[0]), raw=False, strict_map_key=False)
    except Exception as e:
        raise WireError(f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(hdr, dict) or any(k not in hdr for k in HEADER_KEYS):
        raise WireError("header lacks required keys")
    if not isinstance(hdr["bufs"], list) or not isinstance(hdr["body"], bytes):
        raise WireError("header has malformed bufs or body")
    return hdr


def check_token(cfg: WireConfig, hdr: dict) -> bool:
    tok = hdr.get("token")
    # Compare bytes: compare_digest raises TypeError on non-ASCII str, and a forged token
    # like "é" escaped _handle and killed the receiving actor.
    return isinstance(tok, str) and secrets.compare_digest(tok.encode("utf-8", "surrogatepass"),
                                                           cfg.token.encode())


def decode_body(cfg: WireConfig, hdr: dict, frames: list, context: Any = None) -> Any:
    """Rebuild the payload; arrays are zero-copy views of frames or shared memory.

    ``context`` is handed to object codecs (the receiving process's caller, for handles).
    """
    hook = _ExtDecoder([_decode_buf(cfg, spec, frames) for spec in hdr["bufs"]], context)
    try:
        return msgpack.unpackb(hdr["body"], ext_hook=hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"body does not decode: {type(e).__name__}: {e}") from None


class _ExtDecoder:
    """msgpack ext hook. A class, not a closure: a recursive closure is a reference cycle
    that would keep every received array (and its shared-memory segment) alive until
    the cycle collector runs."""

    def __init__(self, arrays: list, context: Any):
        self.arrays, self.context = arrays, context
        self.depth = 0  # object codecs being decoded, one inside the other

    def __call__(self, code: int, data: bytes):
        if code == EXT_ARRAY:
            idx = msgpack.unpackb(data)
            if not isinstance(idx, int) or not 0 <= idx < len(self.arrays):
                raise WireError(f"array reference {idx!r} out of range")
            return self.arrays[idx]
        if code == EXT_CODEC:
            if self.depth >= MAX_CODEC_DEPTH:
                raise WireError(f"object codecs nested more than {MAX_CODEC_DEPTH} deep")
            self.depth += 1
            try:
                tag, state = msgpack.unpackb(data, ext_hook=self, raw=False, strict_map_key=False)
            finally:
                self.depth -= 1
            if tag not in _object_codecs:
                raise WireError(f"unknown object codec {tag!r}")
            return _object_codecs[tag].from_state(state, self.context)
        raise WireError(f"unknown ext type {code}")


def discard(cfg: WireConfig, hdr: dict) -> None:
    """Give back the shared memory of a message whose body will not be decoded (a call
    past its deadline, a stale reply): otherwise its tickets stay set and the sender never
    reuses those segments. Only for messages that carry the run's token."""
    for spec in hdr["bufs"]:
        if isinstance(spec, list) and len(spec) == 5 and isinstance(spec[3], list):
            try:
                _decode_buf(cfg, spec, [])  # maps the segment; dropping the view clears the ticket
            except WireError:
                pass


def _check_size(shape, dtype, needed: int, nbytes: int) -> None:
    if needed != nbytes:
        raise WireError(f"shape {shape} of {dtype} needs {needed} bytes, the buffer has {nbytes}")


def _buf(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _decode_buf(cfg: WireConfig, spec, frames: list):
    if not (isinstance(spec, list) and len(spec) == 5):
        raise WireError(f"malformed buffer spec {spec!r}")
    lib, dtype, shape, where, nbytes = spec
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and 0 <= d <= MAX_DIM for d in shape)):
        raise WireError(f"malformed shape {shape!r}")
    if not isinstance(nbytes, int) or not 0 <= nbytes <= cfg.max_message_bytes:
        raise WireError(f"declared size {nbytes!r} is out of range (max_message_bytes={cfg.max_message_bytes})")
    if isinstance(where, bytes):
        if len(where) != nbytes:
            raise WireError(f"inline buffer holds {len(where)} bytes, header says {nbytes}")
        buf = bytearray(where)  # writable, as a received frame is
    elif _is_int(where):
        if not 1 <= where < len(frames):
            raise WireError(f"frame {where} is missing (message has {len(frames) - 1} frames)")
        buf = _buf(frames[where])
        if buf.nbytes != nbytes:
            raise WireError(f"frame {where} holds {buf.nbytes} bytes, header says {nbytes}")
    elif (isinstance(where, list) and len(where) == 3 and isinstance(where[0], str)
          and _is_int(where[1]) and (where[2] is None or _is_int(where[2]) and 0 <= where[2] < shm.TICKETS)
          and cfg._reader is not None):
        try:
            buf = cfg._reader.read(where[0], where[1], nbytes, where[2])
        except (shm.ShmError, OSError, ValueError) as e:  # also names with NUL or too long for the OS
            raise WireError(str(e)) from None
    else:
        raise WireError(f"malformed buffer location {where!r}")
    count = math.prod(shape)
    if lib == "numpy":
        try:
            dt = np.dtype(dtype)
        except Exception:  # not only TypeError: np.dtype("f4,,") raises SyntaxError
            raise WireError(f"unknown numpy dtype {dtype!r}") from None
        if dt.hasobject or dt.kind in "OUSVMm":
            raise WireError(f"dtype {dtype!r} is not allowed on the wire")
        _check_size(shape, dtype, count * dt.itemsize, nbytes)
        if nbytes:
            return np.frombuffer(buf, dtype=dt).reshape(shape)
        try:  # empty, yet numpy refuses shapes like [2**40, 0, 2**40] ("array is too big")
            return np.empty(shape, dtype=dt)
        except ValueError as e:
            raise WireError(f"shape {shape} of {dtype}: {e}") from None
    if lib == "torch":
        import torch

        tdtype = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(tdtype, torch.dtype):
            raise WireError(f"unknown torch dtype {dtype!r}")
        _check_size(shape, dtype, count * tdtype.itemsize, nbytes)
        if nbytes == 0:
            return torch.empty(shape, dtype=tdtype)
        return torch.frombuffer(buf, dtype=tdtype).reshape(shape)
    raise WireError(f"unknown array library {lib!r}")
