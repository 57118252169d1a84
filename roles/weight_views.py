"""HF tensors as views of megatron's parameters, and the receivers' batched copy of them.

The weight sync reads megatron's parameters without copying them where it can (roles.weight_sync,
direct buckets); q/k/v at TP1 are windows of another shape than HF's (`LazyReshape`).
"""

from __future__ import annotations

from typing import Iterable

import torch


class LazyReshape:
    """An HF tensor given as a view of another shape: `view.reshape(shape)`, not yet made.

    Same elements in the same row-major order, so a receiver copies `view` into its HF-shaped
    parameter viewed as `view.shape` (`copy_into`) and no side copies the reshape. The mapper
    yields these for q/k/v at TP1 when asked (`mapper.to_hf(views=True)`: the weight sync
    only); `pack_buckets` takes them like tensors, and `unpack_bucket` gives them back for a
    direct bucket's windows of another size (module docstring). Read `shape`, `dtype`,
    `device`, `nbytes` as a tensor's; `materialize()` for the HF tensor itself (a copy when
    no view has its shape).
    """

    __slots__ = ("view", "shape")

    def __init__(self, view: torch.Tensor, shape: Iterable[int]):
        shape = torch.Size(shape)
        if shape.numel() != view.numel():
            raise ValueError(f"LazyReshape: a view of {list(view.shape)} ({view.numel()} elements) cannot be "
                             f"read as shape {list(shape)} ({shape.numel()} elements)")
        self.view, self.shape = view, shape

    @property
    def dtype(self) -> torch.dtype:
        return self.view.dtype

    @property
    def device(self) -> torch.device:
        return self.view.device

    @property
    def nbytes(self) -> int:
        return self.view.nbytes

    def materialize(self) -> torch.Tensor:
        return self.view.reshape(self.shape)


# At and above this size a pair is copied by its own `copy_` (a device memcpy at full
# bandwidth); below it pairs are batched, where launches, not bytes, are the cost.
LARGE_COPY_BYTES = 1 << 20


def copy_into(targets: list[torch.Tensor], tensors: list[torch.Tensor | LazyReshape]) -> None:
    """`targets[i].copy_(tensors[i])` in place, where a LazyReshape is copied from its view
    into the target viewed as the view's shape (the target keeps its HF shape; it must be
    viewable so, which any contiguous tensor is).

    Small contiguous pairs go in one `torch._foreach_copy_`; large pairs and strided ones
    (q/k/v windows) each get their own `copy_`. Why (bench.weight_sync's copy-only rows on the
    H200, 8 GB of Qwen3-4B weights; docs/journal/, "Weight sync on one GPU"): one foreach over
    the contiguous pairs and one over the strided take 7.1 ms, one copy_ each 5.7 ms. ATen's
    foreach copy runs multi-tensor-apply kernels, not memcpys, and runs a whole list pair by
    pair when any pair is strided."""
    if len(targets) != len(tensors):
        raise ValueError(f"copy_into: {len(targets)} targets for {len(tensors)} tensors")
    small: tuple[list, list] = ([], [])
    for target, tensor in zip(targets, tensors):
        if isinstance(tensor, LazyReshape):
            target, tensor = target.view(tensor.view.shape), tensor.view
        if tensor.nbytes < LARGE_COPY_BYTES and target.is_contiguous() and tensor.is_contiguous():
            small[0].append(target)
            small[1].append(tensor)
        else:
            target.copy_(tensor)
    if small[0]:
        torch._foreach_copy_(*small)
