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

from typing import Callable, Iterator

import torch
import torch.distributed as dist

NamedTensors = Iterator[tuple[str, torch.Tensor]]
Meta = list[tuple[str, torch.Size, torch.dtype]]


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
