"""The weight sync to engines on other nodes over a broadcast group of its own
(roles.weight_broadcast), on gloo: the actor's sync_weights sends each bucket's tensor by
broadcast to a member of the group and by the usual call to an engine of its own node, bucketed
and double-buffered; both end bit-identical to the actor. The member runs in a thread with its
own ProcessGroupGloo, as an engine process on another node would. The whole path, RolloutEngine
on node 1 included, runs in tests/test_multinode_ppo.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from roles.weight_broadcast import WeightGroup, bucket_meta, receive_bucket
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import unpack_bucket
from runtime.rendezvous import host_store
from tests.test_weight_sync import _bf16_actor, _SlowEngine

pytestmark = pytest.mark.timeout(120)


class _Method:
    def __init__(self, fn):
        self.call = fn


class _BroadcastEngine:
    """An engine handle of another node: `receive_weights.call(meta)` runs, in the engine's own
    thread, what roles/rollout/engine.py's receive_weights does (receive the broadcast, then load
    by name); `join_weight_group` joins as `rank`."""

    def __init__(self):
        self.weights, self.version, self.group, self.buckets = {}, None, None, 0
        self._thread = ThreadPoolExecutor(1)  # one message at a time, as an actor
        self.receive_weights = _Method(lambda meta: self._thread.submit(self._receive, meta))
        self.join_weight_group = _Method(lambda *a: self._thread.submit(self._join, *a))
        self.set_weight_version = _Method(lambda v: self._thread.submit(setattr, self, "version", v))

    def _join(self, addr, port, world, rank, backend):
        self.group = WeightGroup.join(addr, port, world, rank, backend)

    def _receive(self, meta):
        bucket = receive_bucket(self.group, meta)
        for name, view in unpack_bucket(bucket):
            self.weights[name] = view.clone()
        self.buckets += 1
        return {"num_tensors": len(meta["names"])}


def test_the_actor_broadcasts_buckets_to_another_nodes_engine_bit_identical(ckpt):
    actor = _bf16_actor(ckpt)
    local, remote = _SlowEngine(), _BroadcastEngine()
    store = host_store("127.0.0.1", 2)
    joined = remote.join_weight_group.call("127.0.0.1", store.port, 2, 1, "gloo")
    actor.join_weight_group("127.0.0.1", store.port, 2, "gloo")  # returns once both are in
    joined.result(30)
    stats = actor.sync_weights([local, remote], buffer_bytes=16 * 1024, version=3, timeout_s=30.0,
                               by_broadcast=[False, True])
    assert stats["buckets"] > 4 and remote.buckets == stats["buckets"]  # bucketed, every bucket broadcast
    want = actor.weights_checksum()
    assert checksum_named_tensors(local.weights.items()) == want
    assert checksum_named_tensors(remote.weights.items()) == want
    assert local.version == remote.version == 3


def test_a_broadcast_needs_a_group_and_one_flag_per_engine(ckpt):
    from roles.weight_sync import send_to_engines

    with pytest.raises(ValueError, match="needs one entry each, and a weight group"):
        send_to_engines([("w", torch.zeros(4))], [_SlowEngine()], 1024, by_broadcast=[True])
    with pytest.raises(ValueError, match="needs one entry each"):
        send_to_engines([("w", torch.zeros(4))], [_SlowEngine(), _SlowEngine()], 1024, by_broadcast=[False])


def test_bucket_meta_is_the_bucket_without_its_tensor():
    flat = torch.arange(6, dtype=torch.float32)
    meta = bucket_meta({"dtype": "float32", "names": ["a", "b"], "shapes": [[2], [4]], "flat": flat})
    assert meta == {"dtype": "float32", "names": ["a", "b"], "shapes": [[2], [4]], "numel": 6}
