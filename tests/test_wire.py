"""The wire codec: every dtype and odd shape round-trips; bad input is a WireError, never a crash."""

import dataclasses

import msgpack
import numpy as np
import pytest
import torch

from runtime import wire
from runtime.shm import SHM_DIR

NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                "float16", "float32", "float64", "complex64", "complex128"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3), (2, 3, 4)]


def roundtrip(obj, cfg=None):
    cfg = cfg or wire.WireConfig(token="t")
    enc = wire.encode(cfg, {"kind": "call", "id": 1, "src": "a", "dst": "b", "method": "m",
                            "inc": 0, "deadline": None}, obj)
    frames = [bytes(f) for f in enc.frames]
    hdr = wire.decode_header(cfg, frames)
    assert wire.check_token(cfg, hdr)
    return wire.decode_body(cfg, hdr, frames)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_roundtrip(dtype, shape):
    a = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    b = roundtrip(a)
    assert isinstance(b, np.ndarray) and b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_roundtrip(dtype, shape):
    a = (torch.arange(int(np.prod(shape))) % 7).to(torch.float32).reshape(shape).to(dtype)
    b = roundtrip(a)
    assert isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape
    assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 and dtype not in (torch.bool,) else a,
                       b.view(torch.uint8) if b.element_size() == 1 and dtype not in (torch.bool,) else b)


def test_non_contiguous_and_views():
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    a = np.arange(24).reshape(4, 6)
    out = roundtrip({"t": t.T, "slice": t[:, ::2], "a": a.T, "a2": a[::2, 1:]})
    assert torch.equal(out["t"], t.T) and torch.equal(out["slice"], t[:, ::2])
    np.testing.assert_array_equal(out["a"], a.T)
    np.testing.assert_array_equal(out["a2"], a[::2, 1:])


def test_requires_grad_tensor_is_sent_detached():
    t = torch.ones(3, requires_grad=True) * 2
    out = roundtrip(t)
    assert not out.requires_grad and torch.equal(out, t.detach())


def test_nested_structures_and_scalars():
    obj = {"a": [1, 2.5, "x", None, True, b"raw"], "n": {"deep": [np.float32(1.5), np.int64(3)]},
           "tuple": (1, 2), 7: "int key"}
    out = roundtrip(obj)
    assert out == {"a": [1, 2.5, "x", None, True, b"raw"], "n": {"deep": [1.5, 3]}, "tuple": [1, 2],
                   7: "int key"}


def test_unknown_type_is_a_clear_type_error():
    class Thing:
        pass
    with pytest.raises(TypeError, match="cannot send an object of type .*Thing"):
        roundtrip({"x": [Thing()]})
    with pytest.raises(TypeError, match="dtype object"):
        roundtrip(np.array([object()]))


@dataclasses.dataclass(kw_only=True, frozen=True)
class _Settings:
    name: str
    sizes: tuple[int, ...] = ()
    limit: int = 1

    def __post_init__(self):
        if self.limit < 1:
            raise ValueError(f"limit={self.limit}, expected >= 1")


@dataclasses.dataclass(kw_only=True, frozen=True)
class _MoreSettings(_Settings):
    extra: float | None = None


wire.register_config(_Settings)
wire.register_config(_MoreSettings)


def test_a_registered_config_travels_as_itself_with_its_tuples_and_subclass():
    base, more = _Settings(name="a", sizes=(1, 2)), _MoreSettings(name="b", sizes=(3,), extra=0.5)
    out = roundtrip([base, {"nested": more}])
    assert out == [base, {"nested": more}]
    assert type(out[0]) is _Settings and type(out[1]["nested"]) is _MoreSettings  # not its base's codec
    assert out[0].sizes == (1, 2)  # a tuple again, though msgpack carries lists


def test_a_config_is_checked_again_on_arrival_and_an_unregistered_one_is_refused():
    bad = _Settings(name="a")
    object.__setattr__(bad, "limit", 0)  # what a sender with other rules could send
    with pytest.raises(wire.WireError, match="limit=0, expected >= 1"):
        roundtrip(bad)

    @dataclasses.dataclass(frozen=True)
    class Unregistered:
        x: int = 0
    with pytest.raises(TypeError, match="cannot send an object of type .*Unregistered.*register_config"):
        roundtrip(Unregistered())


def test_large_arrays_travel_by_shared_memory_and_segments_are_reused():
    cfg = wire.WireConfig(token="t", shm_prefix="tandem-test-wire")
    try:
        a = np.random.default_rng(0).standard_normal(1 << 19)  # 4 MiB
        enc = wire.encode(cfg, {"kind": "call", "id": 1, "src": "a", "dst": "b", "method": "m",
                                "inc": 0, "deadline": None}, a)
        assert len(enc.frames) == 1 and len(enc.segments) == 1  # only the header travels
        hdr = wire.decode_header(cfg, enc.frames)
        b = wire.decode_body(cfg, hdr, enc.frames)
        np.testing.assert_array_equal(a, b)
        first = enc.segments[0][0]
        del b  # frees the mapping: the segment is handed back to the sender's pool
        enc2 = wire.encode(cfg, {"kind": "call", "id": 2, "src": "a", "dst": "b", "method": "m",
                                 "inc": 0, "deadline": None}, a + 1)
        assert enc2.segments[0][0] == first
        b2 = wire.decode_body(cfg, wire.decode_header(cfg, enc2.frames), enc2.frames)
        np.testing.assert_array_equal(a + 1, b2)
    finally:
        cfg._pool.close()
    import os
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith("tandem-test-wire")]


# --- small arrays inline ----------------------------------------------------------------

INLINE = wire.WireConfig(token="t").inline_max_bytes


def encoded(obj, cfg):
    enc = wire.encode(cfg, {"kind": "call", "id": 1, "src": "a", "dst": "b", "method": "m", "inc": 0,
                            "deadline": None}, obj)
    return enc, [bytes(f) for f in enc.frames]


@pytest.mark.parametrize("nbytes, inline", [(8, True), (INLINE, True), (INLINE + 8, False)])
def test_arrays_up_to_the_threshold_ride_in_the_header(nbytes, inline):
    a = np.arange(nbytes // 8, dtype=np.float64)
    enc, frames = encoded([a, {"x": 1}], wire.WireConfig(token="t"))
    assert len(frames) == (1 if inline else 2)
    hdr = wire.decode_header(wire.WireConfig(token="t"), frames)
    assert isinstance(hdr["bufs"][0][3], bytes) == inline
    b, meta = wire.decode_body(wire.WireConfig(token="t"), hdr, frames)
    np.testing.assert_array_equal(a, b)
    assert meta == {"x": 1}


@pytest.mark.parametrize("inline_max_bytes", [0, INLINE], ids=["frames", "inline"])
@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_dtypes_round_trip_on_both_paths(dtype, inline_max_bytes):
    cfg = wire.WireConfig(token="t", inline_max_bytes=inline_max_bytes)
    a = (torch.arange(6) % 7).to(torch.float32).reshape(2, 3).to(dtype)
    enc, frames = encoded(a, cfg)
    assert len(frames) == (2 if inline_max_bytes == 0 else 1)
    b = wire.decode_body(cfg, wire.decode_header(cfg, frames), frames)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


@pytest.mark.parametrize("a", [np.zeros((3, 0, 2), np.float32), torch.zeros(0, 4, dtype=torch.bfloat16),
                               np.array(5, dtype=np.int64)],
                         ids=["numpy zero-size", "torch zero-size", "0-d"])
def test_zero_size_and_0d_arrays_inline(a):
    cfg = wire.WireConfig(token="t")
    enc, frames = encoded(a, cfg)
    assert len(frames) == 1
    b = wire.decode_body(cfg, wire.decode_header(cfg, frames), frames)
    assert b.shape == a.shape and b.dtype == a.dtype and (b == a).all()


def test_non_contiguous_arrays_inline_and_received_arrays_are_writable_copies():
    cfg = wire.WireConfig(token="t")
    t = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).T  # [6, 4], not contiguous
    a = np.arange(40, dtype=np.int32)[::3]
    enc, frames = encoded([t, a], cfg)
    assert len(frames) == 1
    hdr = wire.decode_header(cfg, frames)
    bt, ba = wire.decode_body(cfg, hdr, frames)
    assert torch.equal(bt, t) and bt.is_contiguous()
    np.testing.assert_array_equal(ba, a)
    ba[0] = -1  # writable, as an array received in a frame is, and not a view of the header
    bt[0, 0] = 7
    assert wire.decode_body(cfg, hdr, frames)[1][0] == 0


def test_many_arrays_in_one_message_keep_their_order():
    """Array references are written by hand (wire._pack_index): one byte below 128, five above."""
    arrays = [np.full(3, i, dtype=np.int32) for i in range(300)]
    got = roundtrip({"xs": arrays})["xs"]
    assert [int(x[0]) for x in got] == list(range(300))


def test_inline_arrays_stop_at_half_the_header_cap():
    cfg = wire.WireConfig(token="t", max_message_bytes=128 * 4096)  # header cap 4 KiB: 2 KiB inline
    arrays = [np.full(128, i, dtype=np.float64) for i in range(5)]  # 1 KiB each
    enc, frames = encoded(arrays, cfg)
    assert len(frames) == 1 + 3  # two inline, three as frames
    assert len(frames[0]) <= cfg.max_header_bytes
    got = wire.decode_body(cfg, wire.decode_header(cfg, frames), frames)
    assert all(np.array_equal(x, y) for x, y in zip(arrays, got))


# --- malformed input --------------------------------------------------------------------

def header(**over):
    h = {"kind": "call", "id": 1, "src": "a", "dst": "b", "method": "m", "inc": 0, "deadline": None,
         "token": "t", "bufs": [], "body": msgpack.packb(None)}
    h.update(over)
    return msgpack.packb(h)


@pytest.mark.parametrize("frames, match", [
    ([], "empty"),
    ([b"\xc1garbage"], "not msgpack"),
    ([msgpack.packb([1, 2])], "lacks required keys"),
    ([header(bufs=[["numpy", "float32", [4], 1, 16]])], "frame 1 is missing"),
    ([header(bufs=[["numpy", "float32", [4], 1, 16]]), b"x" * 15], "holds 15 bytes"),
    ([header(bufs=[["numpy", "float32", [5], 1, 16]]), b"x" * 16], "needs 20 bytes"),
    ([header(bufs=[["numpy", "object", [2], 1, 16]]), b"x" * 16], "not allowed"),
    ([header(bufs=[["numpy", "nonsense", [2], 1, 16]]), b"x" * 16], "unknown numpy dtype"),
    ([header(bufs=[["torch", "bfloat16", [10 ** 12, 10 ** 12], 1, 0]]), b""], "needs"),
    ([header(bufs=[["torch", "float33", [1], 1, 4]]), b"x" * 4], "unknown torch dtype"),
    ([header(bufs=[["numpy", "uint8", [1 << 40], 1, 1 << 40]]), b""], "out of range"),
    ([header(bufs=[["numpy", "uint8", [-1], 1, 1]]), b"x"], "malformed shape"),
    ([header(bufs=[["numpy", "uint8", [4], ["/etc/passwd", 4096, 0], 4]])], "malformed buffer location"),
    ([header(bufs=[["jax", "uint8", [4], 1, 4]]), b"xxxx"], "unknown array library"),
    ([header(bufs=[["numpy", "float32", [4], b"x" * 15, 16]])], "inline buffer holds 15 bytes"),
    ([header(bufs=[["numpy", "float32", [5], b"x" * 16, 16]])], "needs 20 bytes"),
    ([header(body=b"\xd4\x05\x00")], "unknown ext type"),
])
def test_malformed_messages_raise_wire_error(frames, match):
    cfg = wire.WireConfig(token="t", max_message_bytes=1 << 30)
    with pytest.raises(wire.WireError, match=match):
        hdr = wire.decode_header(cfg, frames)
        wire.decode_body(cfg, hdr, frames)


def test_oversized_message_is_rejected_before_decoding():
    cfg = wire.WireConfig(token="t", max_message_bytes=1000)
    with pytest.raises(wire.WireError, match="exceeds max_message_bytes=1000"):
        wire.decode_header(cfg, [header(), b"x" * 2000])


def test_shared_memory_names_outside_the_run_are_refused():
    cfg = wire.WireConfig(token="t", shm_prefix="tandem-mine")
    frames = [header(bufs=[["numpy", "uint8", [4], ["tandem-other-1", 4096, 0], 4]])]
    with pytest.raises(wire.WireError, match="does not belong to this run"):
        wire.decode_body(cfg, wire.decode_header(cfg, frames), frames)


def test_wrong_token_is_detected():
    cfg = wire.WireConfig(token="right")
    hdr = wire.decode_header(cfg, [header(token="wrong")])
    assert not wire.check_token(cfg, hdr)
