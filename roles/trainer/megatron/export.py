"""Weights out of a pipeline-parallel model: the (HF name, tensor) pairs of every pipeline
stage reach pp rank 0 (the rank that sends the weight sync and writes --save-hf), stage
after stage in pipeline order; a later stage yields its own pairs only.

Stage 0 yields its own pairs without communication. Each later stage first broadcasts over
the pipeline group the list of (name, shape, dtype) it will produce (a small pickled
object), then its tensors one at a time; receivers allocate each tensor as it comes.
Memory stays bounded: one tensor beyond what the consumer keeps (the weight sync packs it
into its bucket and drops it). A broadcast rather than send/recv: the same bytes as a send
at PP2, and a collective gloo runs on CUDA tensors (the one-GPU proof has no CUDA
send/recv). With PP > 2 the stages between also receive, and drop, each other's tensors.
Pure torch.distributed; runs on the CPU with gloo (tests/test_megatron_export.py).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from roles.trainer.megatron.mapper import stage_to_hf
from roles.model_spec import ModelSpec
from roles.weight_views import LazyReshape

NamedTensors = Iterator[tuple[str, torch.Tensor | LazyReshape]]
Meta = list[tuple[str, torch.Size, torch.dtype]]


def model_hf_weights(params: Mapping[str, torch.Tensor], shape: ModelSpec, *, tp_size: int,
                     tp_shards: Callable[[str, torch.Tensor], list[torch.Tensor]], pp_group: dist.ProcessGroup | None,
                     pp_rank: int, pp_size: int, spec: str, critic: bool, device: torch.device | str,
                     views: bool = False) -> NamedTensors:
    """The HF pairs of a TP x PP sharded megatron model, as pipeline_named_tensors delivers
    them. `params`: this rank's megatron parameters by name; `tp_shards(name, tensor)`:
    every TP rank's version of one, in rank order (e.g. all_gather_shards: a collective over
    the TP group). The metadata is the mapping run on meta tensors shaped as the TP shards.
    `views` (the weight sync): pp rank 0's own q/k/v at TP1 come as LazyReshapes (mapper.to_hf);
    a later stage's pairs are broadcast, HF-shaped, whatever it is."""
    stage = dict(pp_rank=pp_rank, pp_size=pp_size, spec=spec, critic=critic)

    def own() -> NamedTensors:
        # only pp rank 0 consumes its own pairs here; a later stage broadcasts them (_send)
        return stage_to_hf(lambda name: tp_shards(name, params[name]), shape, **stage, views=views and pp_rank == 0)

    def own_meta() -> Meta:
        pairs = stage_to_hf(lambda name: [params[name].to("meta")] * tp_size, shape, **stage)
        return [(name, t.shape, t.dtype) for name, t in pairs]

    return pipeline_named_tensors(own, own_meta, group=pp_group, device=device)


def all_gather_shards(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> list[torch.Tensor]:
    """Every TP rank's version of a parameter, in rank order (replicated ones too: cheap, and
    mapper.to_hf takes the first); [tensor] without a group."""
    if group is None:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def pipeline_named_tensors(own: Callable[[], NamedTensors], own_meta: Callable[[], Meta], *,
                           group: dist.ProcessGroup | None, device: torch.device | str) -> NamedTensors:
    """On pp rank 0 every stage's pairs in pipeline order, on a later stage its own pairs.

    `own()` yields this stage's pairs (it may run collectives of its own, e.g. a TP
    all-gather); `own_meta()` must list exactly what `own()` yields, without running it.
    `group`: the pipeline group (None: one stage). A collective over it: every rank consumes
    the generator whole. A yielded tensor of another stage is fresh; one of this stage is
    what `own()` yielded (made contiguous when it is sent).
    """
    me = 0 if group is None else dist.get_rank(group)
    if me == 0:
        yield from own()
    if group is None:
        return
    for stage, src in enumerate(dist.get_process_group_ranks(group)[1:], start=1):
        box = [own_meta() if stage == me else None]
        dist.broadcast_object_list(box, src=src, group=group)
        if stage == me:
            yield from _send(own(), box[0], src=src, group=group)
            continue
        for name, size, dtype in box[0]:
            tensor = torch.empty(size, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            if me == 0:
                yield name, tensor


def _send(pairs: NamedTensors, meta: Meta, *, src: int, group: dist.ProcessGroup) -> NamedTensors:
    """Broadcast this stage's pairs, checking each against the announced list: a mismatch
    would otherwise hand the receivers wrong names or shapes silently."""
    announced = iter(meta)
    for name, tensor in pairs:
        expected = next(announced, None)
        if expected != (name, tensor.shape, tensor.dtype):
            raise RuntimeError(f"pipeline weight export: stage yields {(name, tuple(tensor.shape), tensor.dtype)}, "
                               f"announced {expected}")
        tensor = tensor.contiguous()
        dist.broadcast(tensor, src=src, group=group)
        yield name, tensor
    left = list(announced)
    if left:
        raise RuntimeError(f"pipeline weight export: stage announced {len(left)} tensors it did not yield, "
                           f"first {left[0]}")
