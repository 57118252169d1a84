"""Bucket packing: one dtype per bucket, size limit, buffer reuse contract; the production sync;
direct buckets (windows unpacked). Checksums: tests/test_weight_checksum.py."""

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
    from roles.rollout import RolloutEngine
    from runtime import Supervisor

    actor = _bf16_actor(ckpt)
    actor.offload(["optimizer"])
    assert actor._core.memory.kind == "cuda"
    before = actor._core.memory.bytes_in_use()
    with Supervisor(tmp_path / "run", gpus=[0]) as sup:
        sup.leases.acquire(0, "rollout-0")  # as ppo.job spawns an engine
        engine = sup.spawn("rollout-0", RolloutEngine, ckpt, dtype="bfloat16", kv_cache_bytes=64 << 20, gpus=[0])
        sup.wait_ready(timeout=240)
        stats = actor.sync_weights([engine], buffer_bytes=64 * 1024, version=2, engine_gpus=[[0]])
        assert stats["buckets"] > 2
        assert engine.weights_checksum.call().result(60) == actor.weights_checksum()
        assert engine.weight_version.call().result(60) == 2
        assert actor._core.memory.bytes_in_use() == before


# ---- direct buckets: windows into persistent storages travel unpacked ---------------------------


class _IpcRegistry:
    """Stands in for CUDA IPC on the CPU, in one process: `share` files a tensor under a key,
    `open_shared` maps it as a copy in a storage of its own (unlike torch's mapping, which is
    the sender's memory: the copy is what lets a test watch the mapping's STORAGE, which every
    view the receiver derives holds, as torch's IPC ref count does; a weakref to the tensor
    object would die while views of it live on). Unlike torch's, a key opens ONCE (a second
    open raises, as a second mapping of one share would drive torch's producer ref count
    below zero)."""

    def __init__(self):
        self.shared, self.opened, self.num_shares = {}, [], 0

    def share(self, t):
        key, self.num_shares = self.num_shares, self.num_shares + 1
        self.shared[key] = t
        return {"key": key}

    def open_shared(self, d):
        from torch.multiprocessing.reductions import StorageWeakRef

        t = self.shared.pop(d["key"])  # KeyError: a handle mapped twice
        mapped = t.clone()
        self.opened.append(StorageWeakRef(mapped.untyped_storage()))
        return mapped

    def live_mappings(self) -> int:
        import gc

        gc.collect()
        return sum(not ref.expired() for ref in self.opened)


@pytest.fixture
def ipc(monkeypatch):
    """CUDA IPC replaced by `_IpcRegistry`, and every receiver 'sees' the sender's device."""
    import roles.cuda_ipc
    import roles.weight_sync

    registry = _IpcRegistry()
    monkeypatch.setattr(roles.cuda_ipc, "share", registry.share)
    monkeypatch.setattr(roles.cuda_ipc, "open_shared", registry.open_shared)
    monkeypatch.setattr(roles.weight_sync, "_sees", lambda device, gpus: bool(gpus))
    return registry


def _windows_and_temporaries():
    """A megatron-like sender: windows (strided, 3-D) into a flat fp32 and a flat bf16 buffer,
    mixed with tensors that own their storage (temporaries, as the q/k/v regroup makes)."""
    g = torch.Generator().manual_seed(3)
    f32 = torch.randn(400, generator=g)
    b16 = torch.randn(300, generator=g).to(torch.bfloat16)
    return [
        ("w.fused_half", f32[10:70].view(2, 6, 5)[:, 3:]),                      # 3-D, strided (skips rows)
        ("w.temp", torch.randn(4, 3, generator=g)),                             # owns its storage: packed
        ("w.bf16_t", b16[0:60].view(6, 10).t()),                                # transposed bf16 window
        ("w.permuted", f32[100:160].view(3, 4, 5).permute(2, 0, 1)),            # 3-D, permuted strides
        ("w.bf16_temp", torch.randn(5, generator=g).to(torch.bfloat16)),        # packed
        ("w.tail", f32[300:400]),                                               # contiguous window
        ("w.bf16_rows", b16[100:300].view(4, 5, 10)[1:3]),                      # 3-D bf16 window
    ]


def test_direct_planning_lists_windows_unpacked_each_storage_once_after_the_packed_buckets():
    named = _windows_and_temporaries()
    buckets = list(pack_buckets(named, buffer_bytes=1 << 10, direct=lambda device: True))
    packed = [b for b in buckets if "windows" not in b]
    direct = [b for b in buckets if "windows" in b]
    assert buckets[-len(direct):] == direct  # direct buckets come last
    assert sorted(n for b in packed for n in b["names"]) == ["w.bf16_temp", "w.temp"]
    by_dtype = {b["dtype"]: b for b in direct}
    assert set(by_dtype) == {"float32", "bfloat16"} and len(direct) == 2  # one per dtype
    assert by_dtype["float32"]["names"] == ["w.fused_half", "w.permuted", "w.tail"]  # input order
    assert by_dtype["bfloat16"]["names"] == ["w.bf16_t", "w.bf16_rows"]
    for b in direct:
        assert len(b["storages"]) == 1 and "flat" not in b  # one storage, listed once, no buffer
        assert b["storages"][0].dtype == torch.uint8
        assert b["storages"][0].numel() == dict(named)[b["names"][0]].untyped_storage().nbytes()
    assert by_dtype["float32"]["windows"][0] == [0, 10 + 3 * 5, [30, 5, 1]]
    # without `direct` (or for devices it refuses) every tensor is packed, as before
    assert not any("windows" in b for b in pack_buckets(named, 1 << 10))
    assert not any("windows" in b for b in pack_buckets(named, 1 << 10, direct=lambda device: False))


class _Ledger:
    def __init__(self):
        self.charges = []

    def account(self, tag, nbytes):
        assert tag == SYNC_BUFFER_TAG
        self.charges.append(nbytes)


class _CopyingEngine:
    """A receiver as roles/rollout/engine.py's update_weights is: map (`received`), copy by
    name (`unpack_bucket`), drop the mappings, ack. It differs in checking nothing (the real
    engine's checks are exercised below) and acking at once."""

    def __init__(self):
        self.weights, self.kinds = {}, []
        self.update_weights = type("M", (), {"call": staticmethod(self._update)})

    def _update(self, bucket):
        from roles.weight_sync import received

        self.kinds.append("direct" if "cuda_ipc_storages" in bucket else "packed")
        for name, view in unpack_bucket(received(bucket)):
            self.weights[name] = view.clone()
        return _LateAck(lambda: None, [])  # already copied: the ack is ready


def test_direct_round_trip_is_bit_exact_maps_each_share_once_and_charges_no_buffer(ipc):
    from roles.weight_sync import send_to_engines

    named = _windows_and_temporaries()
    engines, ledger = [_CopyingEngine(), _CopyingEngine()], _Ledger()
    totals = send_to_engines(named, engines, buffer_bytes=1 << 10, engine_gpus=[[0], [0]], memory=ledger)
    direct_bytes = sum(t.nbytes for n, t in named if "temp" not in n)
    assert totals["direct_bytes"] == direct_bytes and totals["num_tensors"] == len(named)
    assert totals["num_bytes"] == sum(t.nbytes for _, t in named)
    for engine in engines:
        assert engine.kinds == ["packed", "packed", "direct", "direct"]
        for name, tensor in named:
            got = engine.weights[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.contiguous().reshape(-1).view(torch.uint8))
    assert not ipc.shared and len(ipc.opened) == 2 * 2  # one share per engine and direct bucket, mapped once
    assert ipc.live_mappings() == 0  # the receivers kept no mapping
    # the ledger saw the two packed buffers (1 KiB per dtype of temporaries), nothing for the windows
    assert max(ledger.charges) == 2 * (1 << 10) and ledger.charges[-1] == 0
    only_windows = [(n, t) for n, t in named if "temp" not in n]
    ledger = _Ledger()
    send_to_engines(only_windows, [_CopyingEngine()], buffer_bytes=1 << 10, engine_gpus=[[0]], memory=ledger)
    assert ledger.charges == [0]  # no buffer at all
    # an engine that cannot map the sender's memory: everything packed, for every engine
    mixed = [_CopyingEngine(), _CopyingEngine()]
    totals = send_to_engines(named, mixed, buffer_bytes=1 << 10, engine_gpus=[[0], None])
    assert totals["direct_bytes"] == 0 and all(set(e.kinds) == {"packed"} for e in mixed)


def _tiny_sender(ckpt, device: str = "cpu") -> tuple[list, torch.Tensor]:
    """The tiny checkpoint's weights as a megatron-like sender: bf16 windows into one flat
    buffer (returned too), 2-D weights in turn as transposed views and as row-strided slices
    of a 3-D view (every other row, as a half of an interleaved fused tensor), except the
    q projections, which are temporaries as the q/k/v regroup makes them."""
    from ppo.tiny_model import load_causal_lm

    params = [(n, p.detach().to(torch.bfloat16)) for n, p in load_causal_lm(ckpt).named_parameters()]
    buf = torch.zeros(sum(2 * t.numel() for _, t in params) + 7, dtype=torch.bfloat16, device=device)
    named, offset = [], 7  # no window starts the storage
    for i, (name, t) in enumerate(params):
        if t.dim() == 2 and i % 2:
            view = buf[offset : offset + 2 * t.numel()].view(t.shape[0], 2, t.shape[1])[:, 1]
        elif t.dim() == 2:
            view = buf[offset : offset + t.numel()].view(t.shape[1], t.shape[0]).t()
        else:
            view = buf[offset : offset + t.numel()].view(t.shape)
        offset += 2 * t.numel()
        view.copy_(t)
        named.append((name, view.clone() if "q_proj" in name else view))
    return named, buf


def _megatron_sender(ckpt, device: str = "cpu") -> tuple[list, dict]:
    """The tiny checkpoint's weights as megatron's sender holds them at TP1: every parameter a
    window of one flat bf16 buffer (DDP's param buffer; fused q/k/v per query group, fc1 =
    gate|up), mapped to HF names as the actor's sync asks for them (`stage_to_hf(views=True)`:
    q/k/v as LazyReshapes of strided 3-D windows). Returns (named, hf): hf the HF tensors,
    nudged off the checkpoint's (a trained policy's: an engine started from it must change)."""
    import json
    import os

    from ppo.tiny_model import load_causal_lm
    from roles.trainer.megatron.mapper import hf_to_megatron, stage_to_hf
    from roles.trainer.megatron.shape import shape_from_hf

    with open(os.path.join(ckpt, "config.json")) as f:
        shape = shape_from_hf(json.load(f))
    gen = torch.Generator().manual_seed(5)
    hf = {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16).to(device)
          for n, p in load_causal_lm(ckpt).named_parameters()}
    params = hf_to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
    buf = torch.zeros(sum(t.numel() for t in params.values()), dtype=torch.bfloat16, device=device)
    windows, offset = {}, 0
    for name, t in params.items():
        windows[name] = buf[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return list(stage_to_hf(lambda name: [windows[name]], shape, pp_rank=0, pp_size=1, views=True)), hf


@pytest.mark.timeout(120)
def test_a_real_engine_loads_direct_buckets_bit_identically_and_refuses_an_unknown_name_first(ckpt, ipc):
    from roles.rollout import RolloutEngine
    from roles.weight_sync import for_receiver, send_to_engines

    named, _ = _tiny_sender(ckpt)
    engine = RolloutEngine(ckpt, dtype="bfloat16")
    totals = send_to_engines(named, [_InProcess(engine)], buffer_bytes=16 * 1024, engine_gpus=[[0]])
    assert 0 < totals["direct_bytes"] < totals["num_bytes"]
    assert engine.weights_checksum() == checksum_named_tensors(named)
    assert ipc.live_mappings() == 0  # update_weights dropped its mappings before the ack

    before = engine.weights_checksum()
    changed = [(n, t + 1) if t.dim() == 2 else (n, t) for n, t in named if "q_proj" not in n]
    windows = [(n, t) for n, t in named if "q_proj" not in n]
    with torch.no_grad():
        for (_, t), (_, new) in zip(windows, changed):
            t.copy_(new)  # new values in the sender's buffer, then a name the engine lacks, last
    bad = next(pack_buckets(windows + [("model.no_such.weight", windows[0][1][:1])], 1 << 30,
                            direct=lambda device: True))
    assert "windows" in bad and bad["names"][-1] == "model.no_such.weight"
    with pytest.raises(ValueError, match="unknown tensor 'model.no_such.weight'") as refused:
        engine.update_weights(for_receiver(bad, [0]))
    assert engine.weights_checksum() == before  # refused before any write
    assert refused.tb is not None and ipc.live_mappings() == 0  # the error's traceback holds no mapping
    # the last name known, but its window has another tensor's shape
    wrong = windows[:-1] + [(windows[-1][0], windows[0][1][0])]
    assert wrong[-1][1].shape != windows[-1][1].shape
    bad_shape = next(pack_buckets(wrong, 1 << 30, direct=lambda device: True))
    with pytest.raises(ValueError, match=f"tensor '{windows[-1][0]}' has shape"):
        engine.update_weights(for_receiver(bad_shape, [0]))
    assert engine.weights_checksum() == before
    assert ipc.live_mappings() == 0


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_direct_sync_over_cuda_ipc_is_bit_identical_before_and_after_the_sender_buffer_is_reallocated(ckpt, tmp_path):
    """On a GPU: this process is a megatron-like sender (windows into one flat bf16 buffer,
    transposed and row-strided, plus q/k/v-like temporaries) and syncs to an engine role on
    the same GPU over CUDA IPC. Then the buffer is freed and reallocated as megatron's
    offloader does (`untyped_storage().resize_(0)`, `resize_`): the free must return the
    memory at once (an engine that kept a mapping would park it in torch's IPC limbo), and a
    second sync of new content, from the new address, is bit-identical too. Last, megatron's
    own TP1 layout through the mapper, as the actor's sync reads it: q/k/v go as strided
    windows too, so nothing is packed, and the engine is bit-identical to the HF weights."""
    from roles.rollout import RolloutEngine
    from roles.weight_sync import send_to_engines
    from roles.weight_views import LazyReshape
    from runtime import Supervisor

    named, buf = _tiny_sender(ckpt, device="cuda")
    storage = buf.untyped_storage()
    with Supervisor(tmp_path / "run", gpus=[0]) as sup:
        sup.leases.acquire(0, "rollout-0")  # as ppo.job spawns an engine
        engine = sup.spawn("rollout-0", RolloutEngine, ckpt, dtype="bfloat16", kv_cache_bytes=64 << 20, gpus=[0])
        sup.wait_ready(timeout=240)
        totals = send_to_engines(named, [engine], 16 * 1024, engine_gpus=[[0]])
        assert 0 < totals["direct_bytes"] < totals["num_bytes"]
        assert engine.weights_checksum.call().result(60) == checksum_named_tensors(named)

        torch.cuda.synchronize()
        nbytes, address, before = storage.nbytes(), storage.data_ptr(), torch.cuda.memory_allocated()
        storage.resize_(0)  # the offload
        assert before - torch.cuda.memory_allocated() >= nbytes  # freed now, not parked in IPC limbo
        blocker = torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # the old block is taken: a new address
        storage.resize_(nbytes)  # the onload
        assert storage.data_ptr() != address
        buf.copy_(torch.randn(buf.shape, generator=torch.Generator(device="cuda").manual_seed(1), device="cuda"))
        del blocker
        totals = send_to_engines(named, [engine], 16 * 1024, engine_gpus=[[0]])
        assert totals["direct_bytes"] > 0
        want = checksum_named_tensors(named)
        assert engine.weights_checksum.call().result(60) == want
        assert want != checksum_named_tensors(_tiny_sender(ckpt)[0])  # really new content

        named, hf = _megatron_sender(ckpt, device="cuda")
        assert any(isinstance(t, LazyReshape) for _, t in named)  # q/k/v as windows, not copies
        totals = send_to_engines(named, [engine], 16 * 1024, engine_gpus=[[0]])
        assert totals["direct_bytes"] == totals["num_bytes"] > 0 and totals["num_buckets"] == 1  # 0 packed
        assert engine.weights_checksum.call().result(60) == checksum_named_tensors(hf.items())


def test_sglang_gathers_a_direct_bucket_in_parts_of_bounded_size_in_order():
    """sglang loads flat buckets only: its adapter gathers a direct bucket's views in parts of
    at most DIRECT_GROUP_BYTES (a lone larger tensor alone), bit-exact and in bucket order."""
    from roles.rollout.sglang_backend import direct_groups

    named = [(n, t) for n, t in _windows_and_temporaries() if t.dtype == torch.float32 and "temp" not in n]
    sizes = [t.nbytes for _, t in named]  # 120, 240, 400 bytes
    parts = list(direct_groups(named, max_bytes=360))
    assert [[n for n, _ in part] for part, _, _ in parts] == [["w.fused_half", "w.permuted"], ["w.tail"]]
    assert sizes[0] + sizes[1] <= 360 < sizes[2]
    for part, flat, owned in parts:
        assert owned and flat.dim() == 1
        assert torch.equal(flat, torch.cat([t.contiguous().reshape(-1) for _, t in part]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("megatron", [False, True])
def test_an_sglang_engine_loads_direct_buckets_in_parts_bit_identically(ckpt, ipc, monkeypatch, megatron):
    """The sglang adapter (against tests/fakes/sglang_engine.py, as tests/test_rollout_sglang.py
    runs it) takes direct buckets: parts of at most DIRECT_GROUP_BYTES, each one
    flattened_bucket update inside one weight-update session. From megatron's TP1 layout
    (`_megatron_sender`) q/k/v come as strided windows too, and sglang's loaders take HF-shaped
    tensors (QKVParallelLinear.weight_loader narrows its parameter to the q, k or v shard and
    asserts the shapes equal): the adapter gathers them in HF row-major order under HF shapes
    (the fake's reconstruct_tensors reshapes by the metadata, as sglang's does)."""
    from ppo.tiny_model import EOS_ID
    from roles.rollout import RolloutEngine
    from roles.rollout import sglang_backend
    from roles.weight_sync import send_to_engines
    from tests.fakes import sglang_engine

    fake_sglang = sglang_engine.install(monkeypatch, eos_id=EOS_ID)
    monkeypatch.setattr(sglang_backend, "DIRECT_GROUP_BYTES", 8 * 1024)
    engine = RolloutEngine(ckpt, backend="sglang", dtype="bfloat16")
    fake = fake_sglang.instances[-1]
    named, want = _megatron_sender(ckpt) if megatron else (_tiny_sender(ckpt)[0], None)
    want = want or dict(named)
    totals = send_to_engines(named, [_InProcess(engine)], buffer_bytes=1 << 20, engine_gpus=[[0]])
    engine.set_weight_version(1)
    updates = [c for c in fake.calls if c[0] == "update_weights"]
    # the tiny sender's q_proj temporaries make one packed bucket; megatron's layout packs nothing
    assert totals["num_buckets"] == (1 if megatron else 2) and len(updates) > 2  # the direct one in parts
    assert fake.session is None and set(fake.weights) == set(want)
    for name, tensor in want.items():
        assert fake.weights[name].shape == tensor.shape and torch.equal(fake.weights[name], tensor), name
