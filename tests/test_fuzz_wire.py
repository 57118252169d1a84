"""Fuzzing the wire decoder: whatever arrives, `decode_header` + `check_token` + `decode_body`
raise only `wire.WireError` (no other exception, no crash, no hang), and what decoding
allocates (traced with tracemalloc) depends on the bytes received, never on a size the message
declares: within `budget(frames)`, which for every message here is far below
`max_message_bytes`.

The decoded Python objects of the msgpack part can outgrow the bytes that carried them (an
empty map is one byte on the wire and ~72 in memory): `EXPANSION` is that worst factor, pinned
by `test_msgpack_expansion_is_bounded_by_the_message_not_by_declared_lengths`.
"""

import os
import random
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime import wire
from runtime.events import read_events
from tests.actors import Echo

TOKEN = "fuzz-token"
MAX_MESSAGE_BYTES = 1 << 20
EXPANSION = 80  # worst decoded-Python-bytes per msgpack byte (an array of empty maps: ~72)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHM_PREFIX = f"tandem-fuzz-{os.getpid()}"


def config(**over) -> wire.WireConfig:
    return wire.WireConfig(**{"token": TOKEN, "max_message_bytes": MAX_MESSAGE_BYTES,
                              "shm_prefix": SHM_PREFIX, **over})


def decode(cfg: wire.WireConfig, frames: list) -> tuple[str, int]:
    """Decode like an actor's mailbox does; return (outcome, peak bytes traced while decoding).

    Fails the test on any exception other than WireError, or when decoding takes over 2 s.
    """
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        hdr = wire.decode_header(cfg, frames)
        if not wire.check_token(cfg, hdr):
            outcome = "bad token"
        else:
            value = wire.decode_body(cfg, hdr, frames)
            del value
            outcome = "decoded"
    except wire.WireError:
        outcome = "WireError"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - t0 < 2.0, f"decoding {[bytes(f)[:64] for f in frames]} took too long"
    return outcome, peak


def budget(frames: list) -> int:
    """What decoding `frames` may allocate: proportional to what arrived, plus a little slack."""
    return (64 << 10) + EXPANSION * sum(len(f) for f in frames)


def header(body: bytes = msgpack.packb([[], {}]), **over) -> bytes:
    h = {"kind": "call", "id": 1, "src": "fuzz", "dst": "e", "method": "ping", "inc": 0,
         "deadline": None, "token": TOKEN, "bufs": [], "body": body}
    h.update(over)
    return msgpack.packb(h)


# --- strategies -------------------------------------------------------------------------

HUGE = [2**31, 2**32 - 1, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
DTYPES = ["float32", "bfloat16", "uint8", "bool", "object", "U4", "V8", "f4,,", ">f8", "(2,)f4",
          "float8_e4m3fn", "int64", "Tensor", "__class__", "nn", "O"]
dims = st.one_of(st.integers(-2, 8), st.sampled_from(HUGE))
shapes = st.one_of(st.lists(dims, max_size=6), st.lists(st.just(1), min_size=60, max_size=70),
                   st.integers(0, 9), st.text(max_size=3), st.none())
dtypes = st.one_of(st.sampled_from(DTYPES), st.text(max_size=8), st.integers(-3, 300), st.none(),
                   st.lists(st.text(max_size=3), max_size=2),
                   st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
wheres = st.one_of(st.integers(-2, 5), st.booleans(), st.sampled_from(HUGE),
                   st.tuples(st.one_of(st.text(max_size=20), st.just(SHM_PREFIX + "-0"),
                                       st.just(SHM_PREFIX + "-\x00"), st.just(SHM_PREFIX + "-" + "a" * 300)),
                             st.booleans()).map(list),
                   st.text(max_size=8))
nbytes_ = st.one_of(st.integers(-2, 64), st.sampled_from(HUGE), st.floats(allow_nan=True), st.none())
buf_specs = st.one_of(
    st.tuples(st.sampled_from(["numpy", "torch", "jax", ""]), dtypes, shapes, wheres, nbytes_).map(list),
    st.lists(st.integers(-2**63, 2**64 - 1), max_size=6), st.integers(0, 9), st.text(max_size=4))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                    st.text(max_size=8), st.binary(max_size=8))


@st.composite
def ext_values(draw, depth=0):
    """Ext references: array indices (in range or not), codec tags, unknown codes, garbage."""
    kind = draw(st.sampled_from(["array", "codec", "unknown", "garbage"] if depth < 3 else ["array", "unknown"]))
    if kind == "array":
        return msgpack.ExtType(wire.EXT_ARRAY, msgpack.packb(draw(st.one_of(st.integers(-1, 4), st.text(max_size=2)))))
    if kind == "codec":
        inner = draw(ext_values(depth + 1))
        tag = draw(st.sampled_from(["actor_handle", "nope", ""]))
        return msgpack.ExtType(wire.EXT_CODEC, msgpack.packb([tag, [inner, draw(scalars)]]))
    if kind == "unknown":
        return msgpack.ExtType(draw(st.integers(0, 127)), draw(st.binary(max_size=8)))  # -1..-128: raw bytes
    return msgpack.ExtType(draw(st.sampled_from([wire.EXT_ARRAY, wire.EXT_CODEC])), draw(st.binary(max_size=8)))


payloads = st.recursive(st.one_of(scalars, ext_values()),
                        lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                st.dictionaries(st.text(max_size=4), inner, max_size=4)),
                        max_leaves=12)
bodies = st.one_of(payloads.map(msgpack.packb), st.binary(max_size=64),
                 st.binary(max_size=12).map(lambda b: b"\xc7" + bytes([len(b), 0xff]) + b))  # timestamp ext
header_values = st.one_of(scalars, st.lists(scalars, max_size=3))


@st.composite
def structured_messages(draw):
    """Headers that parse but lie: wrong field types, wrong tokens, bad buffer specs, odd frames."""
    h = {"kind": draw(st.one_of(st.just("call"), header_values)), "id": draw(header_values),
         "src": draw(header_values), "dst": draw(header_values),
         "method": draw(st.one_of(st.just("ping"), header_values)), "inc": draw(header_values),
         "deadline": draw(st.one_of(st.none(), st.floats(), st.integers(-2**63, 2**64 - 1))),
         "token": draw(st.one_of(st.just(TOKEN), st.just("é" * 10), st.just(TOKEN + "\x00"),
                                 st.text(max_size=12), st.binary(max_size=12), st.integers(0, 9))),
         "bufs": draw(st.one_of(st.lists(buf_specs, max_size=3), header_values)),
         "body": draw(st.one_of(bodies, header_values))}
    for key in draw(st.lists(st.sampled_from(wire.HEADER_KEYS), max_size=2, unique=True)):
        del h[key]
    return [msgpack.packb(h)] + draw(st.lists(st.binary(max_size=64), max_size=4))


@st.composite
def mutated_messages(draw):
    """A valid message with arrays, then cut, flipped, resized, dropped or extra frames."""
    body = [[np.arange(draw(st.integers(0, 8)), dtype=np.float32), torch.ones(2, 3, dtype=torch.bfloat16)],
            {"x": draw(scalars)}]
    cfg = config(shm_prefix=None)
    frames = [bytes(f) for f in wire.encode(cfg, {"kind": "call", "id": 1, "src": "a", "dst": "e",
                                                  "method": "ping", "inc": 0, "deadline": None}, body).frames]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(frames) - 1)) if frames else 0
        op = draw(st.sampled_from(["truncate", "flip", "grow", "drop", "add", "swap"]))
        if not frames:
            break
        f = bytearray(frames[i])
        if op == "truncate":
            frames[i] = bytes(f[:draw(st.integers(0, max(0, len(f) - 1)))])
        elif op == "flip" and f:
            j = draw(st.integers(0, len(f) - 1))
            f[j] ^= draw(st.integers(1, 255))
            frames[i] = bytes(f)
        elif op == "grow":
            frames[i] = bytes(f) + draw(st.binary(min_size=1, max_size=16))
        elif op == "drop":
            del frames[i]
        elif op == "add":
            frames.append(draw(st.binary(max_size=32)))
        elif op == "swap" and len(frames) > 1:
            frames[0], frames[-1] = frames[-1], frames[0]
    return frames


# --- msgpack bombs ------------------------------------------------------------------------

def nested_arrays(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


def nested_maps(depth: int) -> bytes:
    return b"\x81\x00" * depth + b"\xc0"


def nested_codecs(depth: int) -> bytes:
    inner = msgpack.packb(None)
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(wire.EXT_CODEC, msgpack.packb(["nope", msgpack.ExtType(2, inner)])))
    return inner


# A length prefix that claims far more than the message holds, for each msgpack container.
HUGE_DECLARATIONS = {
    "array32": b"\xdd\xff\xff\xff\xff", "map32": b"\xdf\xff\xff\xff\xff", "bin32": b"\xc6\xff\xff\xff\xff",
    "str32": b"\xdb\xff\xff\xff\xff", "ext32": b"\xc9\xff\xff\xff\xff\x01",
    "array16 of bin32": b"\xdc\xff\xff" + b"\xc6\x7f\xff\xff\xff" * 8,
}
BOMBS = {
    **{f"header {k}": [v + b"\x00" * 64] for k, v in HUGE_DECLARATIONS.items()},
    **{f"body {k}": [header(body=v + b"\x00" * 64)] for k, v in HUGE_DECLARATIONS.items()},
    "header arrays nested 100k deep": [nested_arrays(100_000)],
    "header maps nested 100k deep": [nested_maps(100_000)],
    "body arrays nested 100k deep": [header(body=nested_arrays(100_000))],
    "body maps nested 100k deep": [header(body=nested_maps(100_000))],
    "body codecs nested 3000 deep": [header(body=nested_codecs(3000))],
    "shape [2**40] declaring 2**40 bytes": [header(bufs=[["numpy", "uint8", [2**40], 1, 2**40]]), b""],
    "shape [2**40, 0, 2**40] declaring 0 bytes": [header(bufs=[["numpy", "uint8", [2**40, 0, 2**40], 1, 0]]), b""],
    "torch shape [2**63, 0]": [header(bufs=[["torch", "uint8", [2**63, 0], 1, 0]]), b""],
    "shape of 100k dims of 2**62": [header(bufs=[["numpy", "uint8", [2**62] * 100_000, 1, 0]]), b""],
    "65 dims": [header(bufs=[["numpy", "uint8", [1] * 65, 1, 1]]), b"x"],
    "shm name with NUL": [header(bufs=[["numpy", "uint8", [4], [SHM_PREFIX + "-\x00", 4096, 0], 4]])],
    "shm name too long": [header(bufs=[["numpy", "uint8", [4], [SHM_PREFIX + "-" + "a" * 5000, 4096, 0], 4]])],
    "numpy dtype that numpy cannot parse": [header(bufs=[["numpy", "f4,,", [1], 1, 4]]), b"xxxx"],
}


# --- tests ---------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", list(BOMBS))
def test_bombs_raise_wire_error_within_budget(name):
    frames = BOMBS[name]
    outcome, peak = decode(config(), frames)
    assert outcome == "WireError", name
    assert peak <= budget(frames), f"{name}: decoding allocated {peak} bytes"


def test_non_ascii_and_odd_tokens_are_refused_not_raised():
    cfg = config()
    for token in ["é", "ü" * 32, TOKEN + "\x00", "", TOKEN[:-1], b"fuzz-token", 7, None, [TOKEN]]:
        assert wire.check_token(cfg, {"token": token}) is False, token
    assert wire.check_token(cfg, {"token": TOKEN}) is True


def test_msgpack_limits_follow_the_message_size():
    """msgpack>=1.0 caps declared container lengths at the size of the buffer it parses (the
    decoder relies on it, pyproject requires it): a 5-byte array32 claiming 2**32 items fails
    at once instead of allocating a 32 GiB list."""
    with pytest.raises(wire.WireError, match="exceeds max_array_len"):
        wire.decode_header(config(), [b"\xdd\xff\xff\xff\xff"])
    with pytest.raises(wire.WireError, match="exceeds max_map_len"):
        wire.decode_body(config(), {"bufs": [], "body": b"\xdf\xff\xff\xff\xff"}, [])
    with pytest.raises(wire.WireError, match="nested more than 16 deep"):
        frames = [header(body=nested_codecs(17))]
        wire.decode_body(config(), wire.decode_header(config(), frames), frames)


def test_header_beyond_its_share_of_max_message_bytes_is_refused_before_parsing():
    cfg = config(max_message_bytes=128 << 10)  # header limit: 1 KiB
    frames = [header(body=b"\xc4\xff" + b"x" * 255), b"y" * 4096]
    wire.decode_header(cfg, frames)  # a small header with a large frame is fine
    big = [header(body=b"\xc5\x08\x00" + b"x" * 2048)]
    with pytest.raises(wire.WireError, match="exceeds max_header_bytes=1024"):
        wire.decode_header(cfg, big)
    # so decoding never allocates more than max_message_bytes, whatever the header holds
    assert EXPANSION * cfg.max_header_bytes < cfg.max_message_bytes


@pytest.mark.timeout(60)
def test_msgpack_expansion_is_bounded_by_the_message_not_by_declared_lengths():
    """The worst msgpack -> Python expansion is an array of empty maps (1 byte each on the wire,
    ~72 in memory). Decoding may cost that factor of the bytes actually received, never more."""
    n = 100_000
    for one in (b"\x80", b"\x90", b"\xa2ab", b"\xcd\x10\x00"):
        body = b"\xdd" + n.to_bytes(4, "big") + one * n
        frames = [header(body=b"\x92" + body + b"\x80")]  # [args, {}] so it decodes fully
        outcome, peak = decode(config(max_message_bytes=1 << 30), frames)
        assert outcome == "decoded"
        assert peak <= EXPANSION * len(frames[0]), (one, peak / len(frames[0]))


@pytest.mark.timeout(60)
@FUZZ
@given(frames=st.lists(st.binary(max_size=256), max_size=4))
def test_random_bytes_only_raise_wire_error(frames):
    outcome, peak = decode(config(), frames)
    assert outcome in ("WireError", "bad token", "decoded")
    assert peak <= budget(frames) <= MAX_MESSAGE_BYTES


@pytest.mark.timeout(60)
@FUZZ
@given(frames=structured_messages())
def test_lying_headers_only_raise_wire_error(frames):
    outcome, peak = decode(config(), frames)
    assert peak <= budget(frames) <= MAX_MESSAGE_BYTES


@pytest.mark.timeout(60)
@FUZZ
@given(frames=mutated_messages())
def test_damaged_messages_only_raise_wire_error(frames):
    outcome, peak = decode(config(), frames)
    assert peak <= budget(frames) <= MAX_MESSAGE_BYTES


@pytest.mark.timeout(60)
@settings(max_examples=100, deadline=None)
@given(frames=mutated_messages(), limit=st.integers(0, 400))
def test_messages_over_the_limit_are_refused_before_parsing(frames, limit):
    total = sum(len(f) for f in frames)
    cfg = config(max_message_bytes=limit)
    if frames and total > limit:
        with pytest.raises(wire.WireError, match="exceeds max_message_bytes"):
            wire.decode_header(cfg, frames)
    else:
        decode(cfg, frames)


# --- a real actor under fire ---------------------------------------------------------------

def _fuzzed_frames(rng: random.Random, token: str) -> list[bytes]:
    """One message for the process test; never names an endpoint other than ping."""
    pick = rng.randrange(6)
    if pick == 0:
        return [rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))]
    if pick == 1:
        return list(rng.choice(list(BOMBS.values())))
    if pick == 2:  # the right token and a body that lies
        body = rng.choice([nested_codecs(rng.randrange(1, 40)), nested_arrays(rng.randrange(1, 2000)),
                           rng.randbytes(rng.randrange(0, 40)), msgpack.packb([[1, 2], {}])])
        bufs = rng.choice([[], [["numpy", "uint8", [2**40], 1, 2**40]], [["torch", "f4,,", [1], 1, 4]]])
        return [header(body=body, bufs=bufs, token=token), rng.randbytes(4)]
    if pick == 3:
        return [header(token=rng.choice(["é", "wrong", token + "x", "\x00"]))]
    if pick == 4:
        return [header(kind=rng.choice(["reply", 3, None]), token=token)]
    whole = header(token=token)
    return [whole[:rng.randrange(1, len(whole))]]


def _expected_rejections(cfg: wire.WireConfig, messages: list[list[bytes]]) -> int:
    """How many of `messages` an actor's mailbox must reject (header, token or kind)."""
    rejected = 0
    for frames in messages:
        try:
            hdr = wire.decode_header(cfg, frames)
        except wire.WireError:
            rejected += 1
            continue
        if not wire.check_token(cfg, hdr) or hdr["kind"] != "call" or not isinstance(hdr["method"], str):
            rejected += 1
    return rejected


@pytest.mark.timeout(60)
def test_actor_under_fuzzed_frames_keeps_serving_and_counts_rejections(sup, run_dir):
    e = sup.spawn("e", Echo)
    pid, incarnation = e.pid(), sup._children["e"].incarnation
    rng = random.Random(20240605)
    messages = [_fuzzed_frames(rng, sup.cfg.token) for _ in range(300)]
    expected = _expected_rejections(sup.cfg, messages)
    assert expected > 100  # the mix exercises the reject path, not only error replies

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(sup.directory.resolve("e").endpoint)
    try:
        for i, frames in enumerate(messages):
            raw.send_multipart(frames)
            if i % 50 == 0:  # calls between the fuzzed frames: the actor serves throughout
                assert e.ping(i) == i
        deadline = time.monotonic() + 20
        while sup._children["e"].stats.get("rejected") != expected and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        raw.close()
    assert sup._children["e"].stats.get("rejected") == expected
    assert e.pid() == pid and sup._children["e"].incarnation == incarnation, "the actor died and restarted"
    assert not [ev for ev in read_events(run_dir) if ev["event"] in ("died", "restarted", "hung", "failed")]
    assert e.ping([1, 2]) == [1, 2]
