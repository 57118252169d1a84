"""Direct buckets: windows into the sender's storages travel unpacked, as views of one CUDA IPC
handle per storage (roles/weight_sync.py module docstring), to the torch engine and to sglang.
Packed buckets and the production sync: tests/test_weight_sync.py."""

import pytest
import torch

from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import SYNC_BUFFER_TAG, pack_buckets, unpack_bucket
from tests.test_weight_sync import _InProcess, _LateAck


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
    from roles.trainer.megatron.shape import megatron_spec

    with open(os.path.join(ckpt, "config.json")) as f:
        shape = megatron_spec(json.load(f))
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
    from roles.rollout import EngineConfig, RolloutEngine
    from roles.weight_sync import for_receiver, send_to_engines

    named, _ = _tiny_sender(ckpt)
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16"))
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
    from roles.rollout import EngineConfig, RolloutEngine
    from roles.weight_sync import send_to_engines
    from roles.weight_views import LazyReshape
    from runtime import Supervisor

    named, buf = _tiny_sender(ckpt, device="cuda")
    storage = buf.untyped_storage()
    with Supervisor(tmp_path / "run", gpus=[0]) as sup:
        sup.leases.acquire(0, "rollout-0")  # as ppo.setup.job spawns an engine
        engine = sup.spawn("rollout-0", RolloutEngine,
                           EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16", kv_cache_bytes=64 << 20), gpus=[0])
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
    from roles.rollout import EngineConfig, RolloutEngine
    from roles.rollout import sglang_backend
    from roles.weight_sync import send_to_engines
    from tests.fakes import sglang_engine

    fake_sglang = sglang_engine.install(monkeypatch, eos_id=EOS_ID)
    monkeypatch.setattr(sglang_backend, "DIRECT_GROUP_BYTES", 8 * 1024)
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", dtype="bfloat16"))
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
