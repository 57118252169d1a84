"""Release/resume of the rollout engine and the DeviceMemory helper, on fake GPUs and the CPU."""

import pytest
import torch

from roles.device import DeviceMemory, HostBlock, nbytes_of
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.torch_engine.backend import HOST_ALIGN, _host_copy_of
from runtime.fakegpu import FakeOutOfMemory, LeaseViolation, create_fake_devices

REQ = [{"id": 0, "prompt_ids": [5, 6, 7], "sampling": {"max_new_tokens": 4, "temperature": 0}}]


@pytest.fixture
def fake_gpus(tmp_path, monkeypatch):
    """Two fake GPUs of 64 MiB; this process sees GPU 0 unless a test says otherwise."""
    devices = create_fake_devices(tmp_path / "gpus", 2, 64 << 20)
    monkeypatch.setenv("TANDEM_FAKE_GPU_DIR", str(tmp_path / "gpus"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return devices


def test_release_resume_moves_the_ledger_and_guards_endpoints(ckpt, fake_gpus):
    gpu = fake_gpus[0]
    gpu.set_lease_holder("rollout-0")
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=4))
    weights = eng._backend.weights_bytes
    kv = eng._backend.kv_cache_bytes
    assert kv == 4 * 64 * eng._backend.kv_bytes_per_token  # default: max_batch_size full-context rows
    assert gpu.usage("rollout-0", "weights") == weights and gpu.usage("rollout-0", "kv_cache") == kv
    assert eng.memory_report() == {"state": "ready", "bytes_in_use": weights + kv}
    expected = eng.generate(REQ)[0]["token_ids"]

    assert eng.release(["kv_cache", "weights"]) == {"state": "released", "bytes_in_use": 0}
    assert gpu.usage("rollout-0") == 0 and eng.engine_state() == "released"
    with pytest.raises(RuntimeError, match=r"generate\(\) while \['cuda_graph', 'kv_cache', 'weights'\] released"):
        eng.generate(REQ)
    with pytest.raises(RuntimeError, match=r"resume\(\['weights'\]\) first"):
        eng.update_weights({"dtype": "float32", "names": [], "shapes": [], "flat": torch.zeros(0)})

    gpu.set_lease_holder("actor")  # someone else holds the GPU now: the engine may not grow
    with pytest.raises(LeaseViolation):
        eng.resume(["weights"])
    assert eng.engine_state() == "released" and gpu.usage("rollout-0") == 0

    gpu.set_lease_holder("rollout-0")
    assert eng.resume(["weights"]) == {"state": "kv_cache_released", "bytes_in_use": weights}
    with pytest.raises(RuntimeError, match="kv_cache"):
        eng.generate(REQ)
    assert eng.resume(["kv_cache"])["state"] == "ready"
    assert gpu.usage("rollout-0") == weights + kv
    assert eng.generate(REQ)[0]["token_ids"] == expected  # offload kept the weights
    assert eng.release(["weights"])["state"] == "weights_released"
    assert eng.release(["weights"])["bytes_in_use"] == kv  # releasing twice is a no-op
    with pytest.raises(ValueError, match="tags="):
        eng.release(["optimizer"])


def test_move_spans_count_only_the_weights_as_copied(ckpt, fake_gpus, monkeypatch):
    """The KV cache and graphs are dropped and rebuilt: a bench must not rate them as copies."""
    fake_gpus[0].set_lease_holder("rollout-0")
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=4))
    spans = []
    monkeypatch.setattr(eng, "publish_span", lambda phase, t0, **f: spans.append((phase, f)))
    eng.release(["kv_cache"])
    eng.release(["weights"])
    eng.resume(["weights", "kv_cache"])
    kv, weights = eng._backend.kv_cache_bytes, eng._backend.weights_bytes
    assert [(p, f["bytes"], f["copied"]) for p, f in spans] == [
        ("release", kv, 0), ("release", weights, weights), ("resume", weights + kv, weights)]


def test_cuda_graph_tag_rides_along_with_weights_and_kv_cache(ckpt, fake_gpus):
    fake_gpus[0].set_lease_holder("rollout-0")
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=4))
    full = eng.memory_report()["bytes_in_use"]
    assert eng.release(["cuda_graph"]) == {"state": "cuda_graph_released", "bytes_in_use": full}  # no graphs on CPU
    with pytest.raises(RuntimeError, match=r"resume\(\['cuda_graph'\]\) first"):
        eng.generate(REQ)
    assert eng.resume(["cuda_graph"])["state"] == "ready"
    eng.release(["kv_cache"])
    assert eng._released == {"kv_cache", "cuda_graph"}  # graphs point into the cache
    with pytest.raises(ValueError, match=r"needs the weights and the KV cache resident; resume\(\['kv_cache'\]\)"):
        eng.resume(["cuda_graph"])
    assert eng.resume(["kv_cache"]) == {"state": "ready", "bytes_in_use": full}
    assert eng._released == set()


def test_constructing_without_the_lease_or_room_fails_clearly(ckpt, fake_gpus):
    with pytest.raises(LeaseViolation, match="rollout-0"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32"))
    fake_gpus[0].set_lease_holder("rollout-0")
    with pytest.raises(FakeOutOfMemory):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", kv_cache_bytes=80 << 20))


def test_mem_fraction_sizes_the_kv_cache_from_the_device(ckpt, fake_gpus):
    fake_gpus[0].set_lease_holder("rollout-0")
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", mem_fraction=0.5))
    assert eng._backend.kv_cache_bytes == (32 << 20) - eng._backend.weights_bytes


def test_device_memory_kinds_and_cpu_ledger(fake_gpus, monkeypatch):
    fake = DeviceMemory("x")
    assert (fake.kind, fake.device, fake.capacity_bytes()) == ("fake", torch.device("cpu"), 64 << 20)
    monkeypatch.delenv("TANDEM_FAKE_GPU_DIR")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, also on a GPU box
    cpu = DeviceMemory("x")
    assert (cpu.kind, cpu.device, cpu.capacity_bytes()) == ("cpu", torch.device("cpu"), None)
    module = torch.nn.Linear(4, 4)
    assert cpu.move(module, "device", tag="weights") is module
    assert cpu.ledger() == {"weights": nbytes_of(module)} and cpu.bytes_in_use() == 0
    cpu.move(module, "cpu", tag="weights")
    assert cpu.ledger() == {}
    with pytest.raises(ValueError, match="where='gpu'"):
        cpu.move(module, "gpu", tag="weights")


def test_account_spans_all_visible_fake_gpus_and_rolls_back(fake_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake_gpus[0].set_lease_holder("tp")
    fake_gpus[1].set_lease_holder("tp")
    mem = DeviceMemory("tp")
    mem.account("weights", 1000)
    assert [d.usage("tp", "weights") for d in fake_gpus] == [1000, 1000]  # per-GPU bytes on each
    fake_gpus[1].set_lease_holder("other")
    with pytest.raises(LeaseViolation):
        mem.account("weights", 5000)
    assert [d.usage("tp", "weights") for d in fake_gpus] == [1000, 1000]  # GPU 0 rolled back
    assert mem.ledger() == {"weights": 1000}
    mem.account("weights", 0)  # shrinking needs no lease
    assert [d.usage("tp") for d in fake_gpus] == [0, 0] and mem.bytes_in_use() == 0


def test_nbytes_counts_tied_weights_once():
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    assert nbytes_of(model) == 10 * 8 * 4
    assert nbytes_of([emb.weight, emb.weight, torch.zeros(3)]) == 10 * 8 * 4 + 12


def test_host_block_is_exact_and_the_engines_host_copy_is_aligned_views_into_one():
    block = HostBlock([3, 0, 5], pin=False)  # unpinned on the CPU: no CUDA call, touch ignored
    assert block.nbytes == 8 and [v.numel() for v in block.views] == [3, 0, 5]
    block.free()
    assert block.views == []

    storages = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7), "empty": torch.zeros(0),
                "c": torch.zeros(2, 2, dtype=torch.float64)}
    block, views = _host_copy_of(storages, pin=False)
    assert block.nbytes == 3 * HOST_ALIGN  # 30, 28 and 32 bytes, each rounded up; the empty one takes none
    base = block._flat.data_ptr()
    for i, (k, t) in enumerate(storages.items()):
        v = views[k]
        assert (v.shape, v.dtype) == (t.shape, t.dtype) and v.untyped_storage().data_ptr() == base
        assert not t.numel() or (v.data_ptr() - base) % HOST_ALIGN == 0  # an empty view's data_ptr is 0
        v.fill_(i + 1)
    for i, (k, t) in enumerate(storages.items()):  # disjoint: no slice overwrote another
        assert torch.equal(views[k], torch.full_like(t, i + 1))


def test_touch_pages_zeroes_every_slice_from_its_own_threads(monkeypatch):
    """Touching must not rely on torch's intra-op threads: roles run with one."""
    import threading

    from roles.device import touch_pages

    seen = set()
    zero = torch.Tensor.zero_

    def recording_zero(t):
        seen.add(threading.get_ident())
        return zero(t)

    monkeypatch.setattr(torch.Tensor, "zero_", recording_zero)
    flat = torch.full((1000,), 7, dtype=torch.uint8)
    touch_pages(flat, threads=4)
    assert int(flat.sum()) == 0
    assert threading.get_ident() not in seen and 1 <= len(seen) <= 4
