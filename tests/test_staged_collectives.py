"""tests/staged_collectives.py, the host-staged backend that the one-GPU megatron tests run
megatron's distributed optimizer and pipeline schedule on: every op megatron takes, through
torch.distributed's own Python API (coalescing manager and batch_isend_irecv included), on 2
CPU ranks, against what the op means (the sums and gathers worked out here)."""

from __future__ import annotations

import pytest
import torch

from tests.test_megatron_parallel import run_gloo_ranks


def _values(rank: int, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * rank


def _staged_worker(rank: int, group) -> dict:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    from tests.staged_collectives import COUNTS, StagedGroup

    out: dict = {"types": [type(group).__name__, type(dist.new_group([0, 1])).__name__],
                 "backend": dist.get_backend(group)}
    assert isinstance(group, StagedGroup)
    t = _values(rank)
    dist.all_reduce(t)
    half = _values(rank).bfloat16()  # megatron's TP all-reduces bf16 activations
    dist.all_reduce(half)
    out["all_reduce"], out["all_reduce_bf16"] = t, half
    # megatron's DDP: bucket reduce-scatters (distributed optimizer) or all-reduces in one coalescing manager
    grads = [_values(rank), _values(rank, 4) * 2]
    shards = [torch.zeros(3), torch.zeros(2)]
    with _coalescing_manager(group, async_ops=True) as cm:
        for shard, grad in zip(shards, grads):
            dist.reduce_scatter_tensor(shard, grad, group=group, async_op=True)
    cm.wait()
    out["reduce_scatter_coalesced"] = shards
    buckets = [_values(rank), _values(rank, 4)]
    with _coalescing_manager(group, async_ops=False):
        for b in buckets:
            dist.all_reduce(b, group=group)
    out["all_reduce_coalesced"] = buckets
    # the distributed optimizer's param all-gather into the flat buffer, from this rank's shard (a view of it)
    params = [torch.zeros(6), torch.zeros(4)]
    with _coalescing_manager(group, async_ops=False):
        for p in params:
            mine = p.view(2, -1)[rank]
            mine.copy_(_values(rank, len(mine)) + 1)
            dist.all_gather_into_tensor(p, mine, group=group)
    out["all_gather_coalesced"] = params
    single = torch.zeros(2)
    dist.reduce_scatter_tensor(single, _values(rank, 4), group=group)
    gathered = torch.zeros(4)
    dist.all_gather_into_tensor(gathered, _values(rank, 2), group=group)
    out["reduce_scatter"], out["all_gather_into_tensor"] = single, gathered
    parts = [torch.zeros(3) for _ in range(2)]
    dist.all_gather(parts, _values(rank, 3), group=group)
    out["all_gather"] = parts
    b = _values(rank, 3)
    dist.broadcast(b, src=1, group=group)
    out["broadcast"] = b
    # megatron's pipeline messages: both stages send before they receive (1F1B's exchanges)
    peer = 1 - rank
    inbox = torch.zeros(5)
    ops = [dist.P2POp(dist.isend, _values(rank, 5) + 0.5, peer, group), dist.P2POp(dist.irecv, inbox, peer, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    out["received"] = inbox
    box = [{"rank": rank}] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0, group=group)
    everyone = [None, None]
    dist.all_gather_object(everyone, rank * 10, group=group)
    dist.barrier(group=group)
    out["objects"] = [box[0], everyone]
    out["counts"] = dict(COUNTS)
    return out


@pytest.mark.timeout(120)
def test_staged_backend_runs_each_collective_as_torch_defines_it(tmp_path):
    ranks = run_gloo_ranks(_staged_worker, tmp_path, backend="staged")
    total = _values(0) + _values(1)
    for rank, r in enumerate(ranks):
        assert r["types"] == ["StagedGroup", "StagedGroup"] and r["backend"] == "staged"
        assert torch.equal(r["all_reduce"], total)
        assert r["all_reduce_bf16"].dtype == torch.bfloat16 and torch.equal(r["all_reduce_bf16"].float(), total)
        assert torch.equal(r["reduce_scatter_coalesced"][0], total.view(2, 3)[rank])
        assert torch.equal(r["reduce_scatter_coalesced"][1], ((_values(0, 4) + _values(1, 4)) * 2).view(2, 2)[rank])
        assert torch.equal(r["all_reduce_coalesced"][0], total)
        assert torch.equal(r["all_reduce_coalesced"][1], _values(0, 4) + _values(1, 4))
        assert torch.equal(r["all_gather_coalesced"][0], torch.cat([_values(0, 3), _values(1, 3)]) + 1)
        assert torch.equal(r["all_gather_coalesced"][1], torch.cat([_values(0, 2), _values(1, 2)]) + 1)
        assert torch.equal(r["reduce_scatter"], (_values(0, 4) + _values(1, 4)).view(2, 2)[rank])
        assert torch.equal(r["all_gather_into_tensor"], torch.cat([_values(0, 2), _values(1, 2)]))
        assert all(torch.equal(p, _values(i, 3)) for i, p in enumerate(r["all_gather"]))
        assert torch.equal(r["broadcast"], _values(1, 3))
        assert torch.equal(r["received"], _values(1 - rank, 5) + 0.5)
        assert r["objects"] == [{"rank": 0}, [0, 10]]
        # the coalescing managers ended in the group's coalesced ops; p2p went through send/recv
        assert r["counts"]["reduce_scatter_tensor"] == 2 and r["counts"]["allreduce_coalesced"] == 1
        assert r["counts"]["allgather_into_tensor"] == 2
        assert r["counts"]["send"] >= 1 and r["counts"]["recv"] >= 1
