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


# ---- tied embeddings ------------------------------------------------------------------------


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


def test_listings_of_a_tied_model_have_one_canonical_name_set(tmp_path):
    from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm

    model = load_causal_lm(build_tiny_checkpoint(str(tmp_path / "tied"), tie_word_embeddings=True))
    params, state = list(model.named_parameters()), list(model.state_dict().items())
    assert "lm_head.weight" in dict(state) and "lm_head.weight" not in dict(params)  # the two listings differ
    assert checksum_named_tensors(params) == checksum_named_tensors(state)
    assert "lm_head.weight" not in checksum_named_tensors(state)
    # the alias listed before its target yields to the stored name
    assert checksum_named_tensors(state[::-1]) == checksum_named_tensors(params)
    # a backend that keeps a separate copy of the tied weight lists it too: same canonical set
    copied = [(n, t.clone()) for n, t in state]
    assert checksum_named_tensors(copied) == checksum_named_tensors(params)
    # an untied lm_head that differs from the embedding is checked like any tensor
    untied = dict(copied)
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    sums = checksum_named_tensors(untied.items())
    assert "lm_head.weight" in sums and sums != checksum_named_tensors(params)


@pytest.mark.timeout(120)
def test_weight_check_holds_after_a_real_sync_of_a_tied_model(tmp_path):
    """Qwen3-4B ties its embeddings: the trainer lists the shared weight once, the engine's
    state_dict twice; --check-weight-update-equal must still hold after a sync."""
    from ppo.loop import check_weights_equal
    from ppo.tiny_model import build_tiny_checkpoint
    from roles.rollout import RolloutEngine
    from roles.trainer import ActorTrainer

    ckpt = build_tiny_checkpoint(str(tmp_path / "tied"), tie_word_embeddings=True)
    actor = ActorTrainer(dict(
        hf_checkpoint=ckpt, dtype="bfloat16", seed=7, lr=1e-3, min_lr=0.0, lr_decay_style="constant",
        lr_warmup_iters=0, weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4,
        micro_batch_size=2, eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean", use_kl_loss=False,
        kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False))
    actor.onload(["params"])
    engine = RolloutEngine(ckpt, dtype="bfloat16")
    assert actor.model.lm_head.weight is actor.model.model.embed_tokens.weight  # really tied
    with torch.no_grad():  # a policy update, as the actor's train step would make
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    before = engine.weights_checksum()
    actor.sync_weights([_InProcess(engine)], buffer_bytes=16 * 1024, version=1)
    want = actor.weights_checksum()
    assert engine.weights_checksum() == want != before
    assert "model.embed_tokens.weight" in want and "lm_head.weight" not in want

    class Job:  # what check_weights_equal reads of a job
        pass

    job = Job()
    job.actor, job.engines = _InProcess(actor), [_InProcess(engine)]
    job.actor.weights_checksum = actor.weights_checksum
    # raises on any difference; a head the sync left stale would differ from the embedding and
    # so stay in the engine's canonical listing: the check would fail
    check_weights_equal(job)
