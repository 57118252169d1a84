"""q/k/v at TP1 as strided windows (roles.weight_views.LazyReshape): the mapper's views against
its packed copies, the bucket format's windows of another size, and every receiver's copy."""

import pytest
import torch

from roles.trainer.megatron.mapper import to_hf, to_megatron
from roles.trainer.megatron.shape import megatron_spec
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import for_receiver, is_window, pack_buckets, received, send_to_engines, unpack_bucket
from roles.weight_views import LazyReshape, copy_into
from tests.test_weight_sync import _InProcess
from tests.test_weight_sync_direct import _megatron_sender, ipc  # noqa: F401  (ipc: a fixture)

QKV = "decoder.layers.0.self_attention.linear_qkv."


def _shape(num_heads: int, num_kv_heads: int, bias: bool):
    # Qwen2 has q/k/v biases, Qwen3 none; 8-wide heads keep the tensors small
    return megatron_spec(dict(model_type="qwen2" if bias else "qwen3", vocab_size=64, hidden_size=16,
                              intermediate_size=32, num_hidden_layers=1, num_attention_heads=num_heads,
                              num_key_value_heads=num_kv_heads, head_dim=8, tie_word_embeddings=True))


def _fused_in_buffer(shape, suffix: str):
    """HF q/k/v of layer 0 (random, distinct values) and megatron's fused parameter built from
    them (mapper.to_megatron), as a window in the middle of a larger flat buffer."""
    g = torch.Generator().manual_seed(len(suffix) + shape.num_heads)
    rest = (shape.hidden_size,) if suffix == "weight" else ()
    q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    hf = {f"model.layers.0.self_attn.{x}_proj.{suffix}": torch.randn(rows, *rest, generator=g).to(torch.bfloat16)
          for x, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
    fused = to_megatron(QKV + suffix, hf, shape, tp_rank=0, tp_size=1, layer_offset=0)
    buffer = torch.zeros(fused.numel() + 24, dtype=torch.bfloat16)
    return hf, buffer[8 : 8 + fused.numel()].view(fused.shape).copy_(fused)


@pytest.mark.parametrize("suffix", ["weight", "bias"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])  # 2 query groups of 2 heads; of 1 head
def test_qkv_windows_are_views_of_the_parameter_equal_to_the_packed_copies(heads, kv_heads, suffix):
    shape = _shape(heads, kv_heads, bias=suffix == "bias")
    hf, param = _fused_in_buffer(shape, suffix)
    packed = to_hf(QKV + suffix, [param], shape, layer_offset=0)
    lazy = to_hf(QKV + suffix, [param], shape, layer_offset=0, views=True)
    assert [n for n, _ in packed] == [n for n, _ in lazy] == list(hf)
    for (name, copy), (_, window) in zip(packed, lazy):
        assert not isinstance(copy, LazyReshape) and torch.equal(copy, hf[name])  # the contract of old
        assert isinstance(window, LazyReshape) and window.shape == hf[name].shape and window.dtype == torch.bfloat16
        assert window.view.dim() == param.dim() + 1 and is_window(window.view)  # [groups, rows, *rest]
        assert window.view.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()  # no copy
        assert torch.equal(window.materialize(), copy)
        target = torch.zeros_like(copy)
        copy_into([target], [window])
        assert torch.equal(target, hf[name]), name
    # the windows through a direct bucket and into HF-shaped receivers, bit-exact
    [bucket] = pack_buckets(lazy, 1 << 14, direct=lambda device: True)
    assert bucket["shapes"] == [list(t.shape) for t in hf.values()]
    assert all(len(w) == 4 for w in bucket["windows"])  # each names its own size
    got = unpack_bucket(bucket)
    targets = [torch.zeros_like(t) for t in hf.values()]
    copy_into(targets, [t for _, t in got])
    assert all(torch.equal(t, want) for t, want in zip(targets, hf.values()))
    # packed instead, the windows land in HF row-major order: the bucket reads back as HF tensors
    [packed_bucket] = pack_buckets(lazy, 1 << 14)
    assert all(torch.equal(t, hf[n]) for n, t in unpack_bucket(packed_bucket))


def test_at_tp2_views_still_gives_copies_that_own_their_memory():
    """A TP gather is a temporary: windows of it would travel direct and keep it alive."""
    shape = _shape(4, 2, bias=False)
    hf, _ = _fused_in_buffer(shape, "weight")
    shards = [to_megatron(QKV + "weight", hf, shape, tp_rank=r, tp_size=2, layer_offset=0) for r in range(2)]
    for name, tensor in to_hf(QKV + "weight", shards, shape, layer_offset=0, views=True):
        assert not isinstance(tensor, LazyReshape) and not is_window(tensor) and torch.equal(tensor, hf[name])


def test_copy_into_batches_small_dense_pairs_and_copies_large_or_strided_ones_alone(monkeypatch):
    """ATen runs a whole _foreach_copy_ list one copy_ per pair when any pair is strided, and a
    large pair copies faster by its own copy_ (a memcpy) than inside a foreach."""
    from roles import weight_views

    calls = []
    real = torch._foreach_copy_
    monkeypatch.setattr(torch, "_foreach_copy_", lambda dst, src: (calls.append(len(dst)), real(dst, src)))
    monkeypatch.setattr(weight_views, "LARGE_COPY_BYTES", 64)  # 16 float32s
    base = torch.arange(40.0)
    window = LazyReshape(base[:24].view(2, 12)[:, 2:8].view(2, 2, 3)[:, :, :], (4, 3))  # strided [2, 2, 3]
    sources = [base[:5], window, base[5:9].view(2, 2), base[:24].view(4, 6).t(), base[16:36]]
    targets = [torch.zeros(5), torch.zeros(4, 3), torch.zeros(2, 2), torch.zeros(6, 4), torch.zeros(20)]
    copy_into(targets, sources)
    assert calls == [2]  # the two small contiguous pairs; the strided and the large (80 B) alone
    assert torch.equal(targets[1], window.materialize()) and torch.equal(targets[3], base[:24].view(4, 6).t())
    assert torch.equal(targets[0], base[:5]) and torch.equal(targets[4], base[16:36])
    with pytest.raises(ValueError, match="2 targets for 1 tensors"):
        copy_into(targets[:2], sources[:1])
    with pytest.raises(ValueError, match="cannot be read as shape"):
        LazyReshape(base[:6], (7,))


def test_a_malformed_window_is_refused_naming_the_tensor():
    base = torch.arange(12.0)
    [bucket] = pack_buckets([("w", LazyReshape(base.view(2, 6)[:, :4].view(2, 2, 2), (4, 2)))], 1 << 10,
                            direct=lambda device: True)
    assert bucket["windows"][0][3] == [2, 2, 2]
    with pytest.raises(ValueError, match="'w' has window"):
        unpack_bucket({**bucket, "windows": [bucket["windows"][0] + [0]]})
    with pytest.raises(ValueError, match="cannot be read as shape"):
        unpack_bucket({**bucket, "shapes": [[3, 2]]})


@pytest.mark.timeout(120)
def test_megatrons_tp1_sync_reaches_a_real_engine_unpacked_and_bit_identical(ckpt, ipc):  # noqa: F811
    from roles.rollout import EngineConfig, RolloutEngine

    named, hf = _megatron_sender(ckpt)
    engine = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="bfloat16"))
    before = engine.weights_checksum()
    totals = send_to_engines(named, [_InProcess(engine)], buffer_bytes=16 * 1024, engine_gpus=[[0]])
    assert totals["direct_bytes"] == totals["num_bytes"] and totals["num_buckets"] == 1  # nothing packed
    want = checksum_named_tensors(hf.items())
    assert engine.weights_checksum() == want != before
    assert ipc.live_mappings() == 0
    # a q window claiming another HF shape is refused before any write
    name, q = next((n, t) for n, t in named if isinstance(t, LazyReshape))
    wrong = LazyReshape(q.view, (q.shape[0] // 2, q.shape[1] * 2))
    [bad] = pack_buckets([(name, wrong)], 1 << 10, direct=lambda device: True)
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape \\[{q.shape[0] // 2}, {q.shape[1] * 2}\\]"):
        engine.update_weights(for_receiver(bad, [0]))
    assert engine.weights_checksum() == want and ipc.live_mappings() == 0


def test_received_windows_of_another_size_unpack_as_lazy_reshapes(ipc):  # noqa: F811
    named, hf = _megatron_sender_like()
    [bucket] = pack_buckets(named, 1 << 10, direct=lambda device: True)
    got = dict(unpack_bucket(received(for_receiver(bucket, [0]))))
    assert isinstance(got["q"], LazyReshape) and not isinstance(got["plain"], LazyReshape)
    assert all(torch.equal(got[n].materialize() if n == "q" else got[n], hf[n]) for n in hf)


def _megatron_sender_like():
    base = torch.arange(40.0)
    q = base[:32].view(2, 4, 4)[:, :2]  # 2 groups of 2 q rows of 4, k/v rows between
    return [("q", LazyReshape(q, (4, 4))), ("plain", base[32:])], {"q": q.reshape(4, 4), "plain": base[32:]}


def test_the_bench_breakdown_pairs_each_bucket_with_its_receipt_and_splits_its_time():
    from bench.weight_sync import bucket_breakdown

    start = 100.0
    sends = [{"direct": False, "bytes": 2 << 20, "sent": 100.001, "acked": 100.006},
             {"direct": True, "bytes": 6 << 20, "sent": 100.002, "acked": 100.010}]
    old = {"direct": True, "bytes": 6 << 20, "start": 90.0, "mapped": 90.1, "copied": 90.2, "dropped": 90.3}
    receipts = [old,  # the warm-up sync's, left over: only the last len(sends) pair up
                {"direct": False, "bytes": 2 << 20, "start": 100.0015, "mapped": 100.0015, "copied": 100.004,
                 "dropped": 100.004},
                {"direct": True, "bytes": 6 << 20, "start": 100.004, "mapped": 100.005, "copied": 100.008,
                 "dropped": 100.0085}]
    rows = bucket_breakdown(start, sends, receipts)
    assert [(r["kind"], r["mib"]) for r in rows] == [("packed", 2), ("direct", 6)]
    want = {"sent": 2, "to_receiver": 2, "map": 1, "copy": 3, "unmap": 0.5, "to_sender": 1.5, "acked": 10}
    assert all(rows[1][k] == pytest.approx(v, abs=1e-6) for k, v in want.items())
    phases = ("to_receiver", "map", "copy", "unmap", "to_sender")
    assert sum(rows[1][k] for k in phases) == pytest.approx(rows[1]["acked"] - rows[1]["sent"], abs=1e-6)
    with pytest.raises(ValueError, match="do not pair up"):
        bucket_breakdown(start, sends, receipts[:2])
    with pytest.raises(ValueError, match="2 buckets sent but 1 received"):
        bucket_breakdown(start, sends, receipts[:1])
