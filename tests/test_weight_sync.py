"""Bucket packing: one dtype per bucket, size limit, buffer reuse contract, exact checksums."""

import pytest
import torch

from roles.weight_sync import (
    checksum_named_tensors,
    pack_buckets,
    push_weights,
    unpack_bucket,
)


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


def test_unpack_rejects_inconsistent_buckets():
    bucket = next(pack_buckets([("w", torch.ones(3, 2))], buffer_bytes=64))
    with pytest.raises(ValueError, match="expected 1-D with 6 elements"):
        unpack_bucket({**bucket, "flat": bucket["flat"][:5]})
    with pytest.raises(ValueError, match="dtype"):
        unpack_bucket({**bucket, "dtype": "bfloat16"})
    with pytest.raises(ValueError, match="buffer_bytes"):
        next(pack_buckets([("w", torch.ones(2))], buffer_bytes=0))


def test_checksums_are_exact_for_bfloat16_and_see_dtype_and_shape():
    t = torch.randn(4, 4).to(torch.bfloat16)
    base = checksum_named_tensors([("w", t)])["w"]
    assert checksum_named_tensors([("w", t.clone())])["w"] == base
    nudged = t.clone()
    nudged.view(torch.int16)[0, 0] += 1  # flip the lowest mantissa bit of one element
    assert checksum_named_tensors([("w", nudged)])["w"] != base
    assert checksum_named_tensors([("w", t.view(16))])["w"] != base
    assert checksum_named_tensors([("w", t.view(torch.float16))])["w"] != base
    assert checksum_named_tensors([("w", t.t())])["w"] != base  # non-contiguous is fine, differs
