"""Arrays allocated in shared memory travel by reference: no copy, only a ticket on the wire."""

import gc
import os
import time

import numpy as np
import pytest
import torch
import zmq

from runtime import CallTimeout, Supervisor, shared_empty, shm, wire
from runtime.errors import RuntimeActorError
from runtime.handle import Address, Caller, Directory
from tests.actors import SharedUser

pytestmark = pytest.mark.timeout(60)
HEADER = {"kind": "call", "id": 1, "src": "a", "dst": "b", "method": "m", "inc": 0, "deadline": None}


@pytest.fixture
def cfg():
    cfg = wire.WireConfig(token="t", shm_prefix="tandem-test-shared")
    shm.set_process_pool(cfg._pool)
    yield cfg
    shm.clear_process_pool(cfg._pool)
    cfg._pool.close()


def send(cfg, value):
    enc = wire.encode(cfg, HEADER, value)
    return enc, wire.decode_body(cfg, wire.decode_header(cfg, enc.frames), enc.frames)


def segment_of(cfg, arr) -> str:
    ptr = arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data_ptr()
    return next(s.name for s in cfg._pool._segments if s.start <= ptr < s.start + s.size)


def test_a_shared_array_and_its_slices_travel_by_reference(cfg):
    a = shared_empty((1 << 20,), "float32")  # 4 MiB
    a[:] = np.arange(a.size)
    enc, b = send(cfg, {"whole": a, "tail": a[1 << 19:]})
    assert len(enc.frames) == 1  # only the header travels
    assert [name for name, *_ in enc.segments] == [segment_of(cfg, a)] * 2
    np.testing.assert_array_equal(b["tail"], a[1 << 19:])
    a[-1] = -5.0  # the receiver sees the sender's memory: nothing was copied
    assert b["whole"][-1] == -5.0 and b["tail"][-1] == -5.0


def test_a_non_contiguous_view_is_copied_into_another_segment(cfg):
    a = shared_empty((1 << 20,), "float32")
    a[:] = 1.0
    enc, b = send(cfg, a[::2])
    assert enc.segments[0][0] != segment_of(cfg, a)
    a[0] = 9.0
    assert b[0] == 1.0  # a copy: later writes do not show


def test_torch_dtypes_and_shapes(cfg):
    t = shared_empty((4, 1 << 17), torch.bfloat16)
    assert isinstance(t, torch.Tensor) and t.shape == (4, 1 << 17) and t.dtype == torch.bfloat16
    t.fill_(1.5)
    enc, u = send(cfg, t)
    assert len(enc.frames) == 1 and torch.equal(u, t)
    t[0, 0] = 3.0
    assert u[0, 0].item() == 3.0


def test_a_segment_is_reused_only_when_its_owner_and_every_receiver_let_go(cfg):
    a = shared_empty(1 << 20, "uint8")
    first = segment_of(cfg, a)
    _, b1 = send(cfg, a)  # two receivers, as in a broadcast: two tickets
    _, b2 = send(cfg, a)
    del a
    c = shared_empty(1 << 20, "uint8")
    assert segment_of(cfg, c) != first  # receivers still view it
    del b1, c
    d = shared_empty(1 << 20, "uint8")
    assert segment_of(cfg, d) != first  # one receiver still does
    del b2, d
    assert segment_of(cfg, shared_empty(1 << 20, "uint8")) == first  # the oldest free segment


def test_a_receiver_that_died_gives_its_ticket_back(cfg):
    a = shared_empty(1 << 20, "uint8")
    first = segment_of(cfg, a)
    enc = wire.encode(cfg, HEADER, a)  # never decoded: its receiver died
    cfg.release(enc.segments)
    del a
    assert segment_of(cfg, shared_empty(1 << 20, "uint8")) == first


def test_shared_empty_outside_a_runtime_says_what_to_do(monkeypatch):
    monkeypatch.setattr(shm, "_process_pool", None)
    with pytest.raises(RuntimeError, match="while a Supervisor.transport=.ipc.. runs"):
        shared_empty(4)
    with pytest.raises(ValueError, match="non-negative"):
        shm.set_process_pool(shm.SegmentPool("tandem-test-none"))
        shared_empty((2, -1))


def test_shared_arrays_cross_processes_both_ways(run_dir):
    with Supervisor(run_dir) as sup:
        u = sup.spawn("u", SharedUser)
        a = shared_empty(1 << 18, "float32")  # 1 MiB
        a[:] = 0.0
        assert u.fill(a, 7.0) == a.nbytes
        assert np.all(a == 7.0)  # the role wrote into the driver's memory
        b = u.make_shared(1 << 18, 2.0)
        assert b.shape == (1 << 18,) and np.all(b == 2.0)
        u.write_kept(3.0)
        assert np.all(b == 3.0)  # a view of the role's memory, not a copy
        assert sup.cfg._reader._maps  # the driver keeps its mapping of the role's segment
    assert not sup.cfg._reader._maps  # shutdown lets go of it, so its pages can be freed
    with pytest.raises(RuntimeError, match="while a Supervisor.transport=.ipc.. runs"):
        shared_empty(4)  # the supervisor's pool went with it


def test_small_shared_arrays_are_shared_too(cfg):
    a = shared_empty(16, "float32")
    a[:] = 1.0
    enc, b = send(cfg, a)
    assert len(enc.frames) == 1  # a reference, although below shm_min_bytes
    a[0] = 2.0
    assert b[0] == 2.0


def test_a_forked_child_dropping_its_copy_does_not_free_the_parents_view(cfg):
    a = shared_empty(1 << 20, "uint8")
    first = segment_of(cfg, a)
    _, b = send(cfg, a)
    del a
    pid = os.fork()
    if pid == 0:  # the child drops its inherited copy of the received view
        del b
        gc.collect()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert segment_of(cfg, shared_empty(1 << 20, "uint8")) != first  # b still views it
    del b
    assert segment_of(cfg, shared_empty(1 << 20, "uint8")) == first


def test_a_call_that_cannot_be_sent_gives_its_tickets_back(cfg):
    directory = Directory()
    directory.update(Address("x", 0, "ipc:///nonexistent/x.sock"))
    caller = Caller(zmq.Context.instance(), cfg, "me", directory)
    caller.close()
    a = shared_empty(1 << 20, "uint8")
    first = segment_of(cfg, a)
    with pytest.raises(RuntimeActorError, match="closed"):
        caller.call("x", "m", (a,), {}, None)
    del a
    assert segment_of(cfg, shared_empty(1 << 20, "uint8")) == first


def test_messages_that_are_never_decoded_give_their_shared_memory_back(run_dir):
    with Supervisor(run_dir) as sup:
        u = sup.spawn("u", SharedUser)
        busy = u.late_array.call(0.5, 1)
        # past its deadline before the role starts it: the role answers "timeout" unread
        late = u.fill.call(np.zeros(1 << 20, dtype=np.uint8), 1, timeout=0.2)
        with pytest.raises(CallTimeout):
            late.result()
        busy.result()
        # the reply comes after the caller gave up: the driver drops it unread
        with pytest.raises(CallTimeout):
            u.late_array(0.3, 1 << 20, timeout=0.1)
        # The stale reply is read (and dropped) when the driver next pumps, i.e. during the
        # next call; poll until the role sees its ticket back.
        deadline = time.monotonic() + 10
        while not u.pool_is_free():
            assert time.monotonic() < deadline, "the role's segment was never given back"
            time.sleep(0.05)
        assert all(s.free() for s in sup.cfg._pool._segments)


def test_the_receiver_keeps_mappings_within_its_bound_and_notices_removed_segments(cfg):
    cfg._reader.max_mapped_bytes = 3 << 20  # room for one 2 MiB segment
    a, b = shared_empty(1 << 20, "uint8"), shared_empty(1 << 20, "uint8")
    a[:], b[:] = 1, 2
    enc_a, ra = send(cfg, a)
    _, rb = send(cfg, b)
    assert list(cfg._reader._maps) == [segment_of(cfg, b)]  # a's mapping left the cache...
    assert ra.sum() == a.nbytes and rb.sum() == 2 * b.nbytes  # ...and lives on under ra
    del a, b, ra, rb
    cfg._pool.close()  # the owner removes its segments
    with pytest.raises(wire.WireError, match="is gone"):  # a new mapping of a removed one
        wire.decode_body(cfg, wire.decode_header(cfg, enc_a.frames), enc_a.frames)
    fresh, _ = send(cfg, np.ones(1 << 20, dtype=np.uint8))  # the pool makes a new segment
    assert list(cfg._reader._maps) == [fresh.segments[0][0]]  # b's removed segment let go


def test_a_late_release_does_not_clear_the_same_ticket_issued_again(cfg):
    a = shared_empty(1 << 20, "uint8")
    seg = next(s for s in cfg._pool._segments if s.views)
    enc, b = send(cfg, a)  # its receiver reads it, then dies before the reply arrives
    del b  # the receiver had already let go: its ticket is clear
    seg._cursor = enc.segments[0][1]  # the ring comes round to the same ticket byte...
    enc2, b2 = send(cfg, a)  # ...for a message that is being read now
    assert enc2.segments[0][1] == enc.segments[0][1]
    cfg.release(enc.segments)  # the death notice for the first message arrives late
    del a
    assert not seg.free()  # b2 still holds its ticket
    del b2
    assert seg.free()
