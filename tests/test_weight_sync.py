"""Bucket packing: one dtype per bucket, size limit, buffer reuse contract; the production sync.
Direct buckets (windows unpacked): tests/test_weight_sync_direct.py. Checksums:
tests/test_weight_checksum.py."""

import pytest
import torch

from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import (
    SYNC_BUFFER_TAG,
    SYNC_NUM_BUFFERS,
    pack_buckets,
    push_weights,
    unpack_bucket,
)
from runtime import CallTimeout, RemoteError


def _named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(4, 8, generator=g)),                     # 128 B fp32
        ("b.weight", torch.randn(16, generator=g).to(torch.bfloat16)),     # 32 B bf16
        ("c.weight", torch.randn(3, 5, generator=g)),                     # 60 B fp32
        ("d.bias", torch.randn(7, generator=g).to(torch.bfloat16)),        # 14 B bf16
        ("e.big", torch.randn(100, generator=g)),                         # 400 B fp32: own bucket
        ("f.scalar", torch.tensor(3.5)),                                  # 0-d, 4 B fp32
    ]


def _copy_received(named, buffer_bytes):
    """Receive like an engine: copy each tensor before resuming the generator."""
    received, buckets = {}, []
    for bucket in pack_buckets(named, buffer_bytes):
        buckets.append({k: bucket[k] for k in ("dtype", "names", "shapes")})
        assert bucket["flat"].dim() == 1
        for name, tensor in unpack_bucket(bucket):
            received[name] = tensor.clone()
    return received, buckets


def test_round_trip_is_exact_and_buckets_hold_one_dtype_within_the_limit():
    named = _named()
    received, buckets = _copy_received(named, buffer_bytes=150)
    assert set(received) == {n for n, _ in named}
    for name, tensor in named:
        assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    for b in buckets:
        dtype = getattr(torch, b["dtype"])
        nbytes = sum(torch.Size(s).numel() for s in b["shapes"]) * torch.empty((), dtype=dtype).element_size()
        assert nbytes <= 150 or len(b["names"]) == 1  # only a lone oversized tensor exceeds it
    assert ["e.big"] in [b["names"] for b in buckets]
    # 128 + 60 > 150 bytes: a and c of fp32 cannot share a bucket
    assert not any({"a.weight", "c.weight"} <= set(b["names"]) for b in buckets)


def test_one_buffer_per_dtype_is_reused_between_buckets():
    named = [(f"t{i}", torch.full((10,), float(i))) for i in range(5)]  # 40 B each
    storages = []
    for bucket in pack_buckets(named, buffer_bytes=80):
        storages.append(bucket["flat"].untyped_storage().data_ptr())
    assert len(storages) == 3  # 2 + 2 + 1 tensors
    assert len(set(storages)) == 1


def test_a_bucket_not_copied_before_resuming_is_overwritten():
    # Documents the contract: the receiver must copy before the sender packs the next bucket.
    named = [("x", torch.zeros(4)), ("y", torch.ones(4))]
    views = [unpack_bucket(b)[0][1] for b in pack_buckets(named, buffer_bytes=16)]
    assert torch.equal(views[0], torch.ones(4))  # "x" was overwritten by "y"


def test_push_weights_counts_and_waits_per_bucket():
    named = _named()
    seen = []
    totals = push_weights(named, lambda b: seen.append(len(b["names"])), buffer_bytes=150)
    assert totals["num_buckets"] == len(seen)
    assert totals["num_tensors"] == sum(seen) == len(named)
    assert totals["num_bytes"] == sum(t.numel() * t.element_size() for _, t in named)


def test_strided_views_are_packed_in_their_row_major_order():
    """The megatron mapper hands the packer views (fc1's halves, q/k/v splits of a fused
    tensor): one batched copy must read them exactly as .contiguous() would."""
    fused = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # 2 groups of 4 q rows, k, v
    q, k, v = fused.split([4, 1, 1], dim=1)
    named = [("t", fused[0].t()), ("q", q), ("k", k), ("v", v), ("s", torch.tensor(2.0)), ("half", fused[1, 3:])]
    received, _ = _copy_received(named, buffer_bytes=1 << 10)
    for name, tensor in named:
        assert torch.equal(received[name], tensor.contiguous()), name


def test_double_buffering_keeps_a_bucket_intact_until_its_acks():
    named = [(f"t{i}", torch.full((10,), float(i))) for i in range(7)]  # 40 B each: 2 per 80-B bucket
    storages, outstanding, waited = [], [], []

    class Ack:
        def __init__(self, bucket):
            self.bucket, self.expected = bucket, bucket["flat"].clone()
            outstanding.append(self)

        def result(self):
            # the receivers are still reading this bucket: packing the next one must not have touched it
            assert torch.equal(self.bucket["flat"], self.expected)
            outstanding.remove(self)
            waited.append(self.bucket["names"])

    def send(bucket):
        storages.append(bucket["flat"].untyped_storage().data_ptr())
        assert len(outstanding) <= 1  # at most the previous bucket is still being read
        return Ack(bucket)

    totals = push_weights(named, send, buffer_bytes=80, num_buffers=2)
    assert totals["num_buckets"] == 4 and not outstanding
    assert waited == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"]]
    assert storages[0] == storages[2] != storages[1] == storages[3]  # two buffers, in turn
    with pytest.raises(ValueError, match="num_buffers"):
        next(pack_buckets(named, 80, num_buffers=0))


def test_unpack_rejects_inconsistent_buckets():
    bucket = next(pack_buckets([("w", torch.ones(3, 2))], buffer_bytes=64))
    with pytest.raises(ValueError, match="expected 1-D with 6 elements"):
        unpack_bucket({**bucket, "flat": bucket["flat"][:5]})
    with pytest.raises(ValueError, match="dtype"):
        unpack_bucket({**bucket, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="buffer_bytes"):
        next(pack_buckets([("w", torch.ones(2))], buffer_bytes=0))


class _InProcess:
    """An in-process actor as a handle: `handle.method.call(...)` returns a resolved future."""

    def __init__(self, obj):
        self._obj = obj
        self.name = type(obj).__name__

    def __getattr__(self, method):
        fn = getattr(self._obj, method)

        class _Done:
            def __init__(self, value):
                self.value = value

            def result(self, timeout=None):
                return self.value

        class _Method:
            call = staticmethod(lambda *a, **k: _Done(fn(*a, **k)))

        return _Method()


# ---- the production sync: double buffered, acks from every engine ---------------------------


class _LateAck:
    """A call's future whose work runs when the caller waits on it (once)."""

    def __init__(self, work, timeouts: list):
        self.work, self.timeouts, self.done = work, timeouts, False

    def result(self, timeout=None):
        self.timeouts.append(timeout)
        if not self.done:
            self.done = True
            return self.work()


class _SlowEngine:
    """An engine handle (`update_weights.call`, `set_weight_version.call`) whose ack is late:
    it reads a bucket only when the sender waits for the ack, as an engine still copying
    would, so a buffer packed again before its ack shows up as wrong weights. The real
    engine copies on receipt and acks after (roles/rollout/engine.py); this one defers the
    copy to the latest moment the contract allows. `fail_at`: the bucket whose ack raises
    `error` (an engine's RemoteError, a CallTimeout)."""

    def __init__(self, fail_at: int | None = None, error: Exception | None = None):
        self.weights, self.version, self.timeouts = {}, None, []
        self.calls = self.outstanding = self.max_outstanding = 0
        self.fail_at, self.error = fail_at, error
        self.update_weights = type("M", (), {"call": staticmethod(self._update)})
        self.set_weight_version = type("M", (), {"call": staticmethod(
            lambda v: _LateAck(lambda: setattr(self, "version", v), []))})

    def _update(self, bucket):
        index, self.calls = self.calls, self.calls + 1
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)

        def load():
            self.outstanding -= 1
            if index == self.fail_at:
                raise self.error
            for name, view in unpack_bucket(bucket):
                self.weights[name] = view.clone()
            return {"num_tensors": len(bucket["names"])}

        return _LateAck(load, self.timeouts)


def _bf16_actor(ckpt):
    from tests.test_trainer import make_actor

    actor = make_actor(ckpt, dtype="bfloat16")
    with torch.no_grad():  # weights unlike the engines' zeros and the initial checkpoint
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.device))
    return actor


@pytest.mark.timeout(120)
def test_slow_acks_keep_two_buckets_in_flight_and_the_weights_bit_identical(ckpt):
    actor = _bf16_actor(ckpt)
    engines = [_SlowEngine(), _SlowEngine()]
    stats = actor.sync_weights(engines, buffer_bytes=16 * 1024, version=4, timeout_s=7.0)
    assert stats["buckets"] > 4
    for engine in engines:
        # two buckets in flight (double buffering), never three: a buffer is packed again only
        # after its bucket's acks; the late copies would otherwise read the next bucket's bytes
        assert engine.max_outstanding == SYNC_NUM_BUFFERS == 2 and engine.outstanding == 0
        assert checksum_named_tensors(engine.weights.items()) == actor.weights_checksum()
        assert engine.version == 4 and set(engine.timeouts) == {7.0}  # each ack waited with timeout_s


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [RemoteError("rollout-1", "update_weights", "ValueError", "bad shape", "tb"),
                                   CallTimeout("rollout-1: no reply within 7 s (the call is still pending)")])
def test_an_engine_failing_mid_sync_stops_it_with_its_error_and_frees_the_buffers(ckpt, tmp_path, monkeypatch, error):
    from tests.test_phase_memory import _actor_on_fake_gpu, _charges

    actor, device = _actor_on_fake_gpu(ckpt, tmp_path, monkeypatch, 1 << 30)
    engines = [_SlowEngine(), _SlowEngine(fail_at=2, error=error)]
    with pytest.raises(type(error), match="rollout-1"):
        actor.sync_weights(engines, buffer_bytes=16 * 1024, version=5, timeout_s=7.0)
    assert all(e.version is None for e in engines)  # no engine was told the sync finished
    assert engines[1].calls == 4  # buckets 0-3 were sent: bucket 2's ack failed when 3 was in flight
    charges = _charges(device, SYNC_BUFFER_TAG)
    assert max(charges) == 2 * 16 * 1024 and charges[-1] == 0 and device.usage("actor", SYNC_BUFFER_TAG) == 0


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_the_production_sync_over_cuda_ipc_is_bit_identical_and_frees_both_buffers(ckpt, tmp_path):
    """On a GPU: the actor (this process) sends to an engine role on the same GPU over CUDA
    IPC, two buckets in flight; the engine ends bit-identical to the actor, and the actor's
    device memory afterwards is what it was before (both buffers gone, none kept for IPC)."""
    from roles.rollout import EngineConfig, RolloutEngine
    from runtime import Supervisor

    actor = _bf16_actor(ckpt)
    actor.offload(["optimizer"])
    assert actor._core.memory.kind == "cuda"
    before = actor._core.memory.bytes_in_use()
    with Supervisor(tmp_path / "run", gpus=[0]) as sup:
        sup.leases.acquire(0, "rollout-0")  # as ppo.setup.job spawns an engine
        engine = sup.spawn("rollout-0", RolloutEngine,
                           EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16", kv_cache_bytes=64 << 20), gpus=[0])
        sup.wait_ready(timeout=240)
        stats = actor.sync_weights([engine], buffer_bytes=64 * 1024, version=2, engine_gpus=[[0]])
        assert stats["buckets"] > 2
        assert engine.weights_checksum.call().result(60) == actor.weights_checksum()
        assert engine.weight_version.call().result(60) == 2
        assert actor._core.memory.bytes_in_use() == before


# ---- direct buckets: windows into persistent storages travel unpacked ---------------------------
