"""Exact digests of HF-named weights: what `--check-weight-update-equal` compares between the
trainer and the engines (ppo.gpu.handoffs.check_weights_equal), however each side lists tied weights.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

import torch

from roles.weight_sync import dtype_name

NamedTensors = Iterable[tuple[str, torch.Tensor]]  # plain tensors, HF-shaped

# HF's tied-weight convention (`_tied_weights_keys` of the *ForCausalLM classes): the output
# projection aliases the input embedding, and a checkpoint stores the embedding's name only.
TIED_ALIASES = {"lm_head.weight": "model.embed_tokens.weight"}


def canonical_named_tensors(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors as an HF checkpoint stores them: every tied alias dropped.

    Two listings of one model differ in how they show tied weights: `named_parameters()`
    lists a shared parameter once, `state_dict()` under every name (Qwen3-4B's
    `lm_head.weight` is `model.embed_tokens.weight`). Memory listed under several names is
    kept once, under its first name, except that a tied alias (`TIED_ALIASES`) yields to the
    name HF stores, as `save_pretrained` does. An alias that is a separate but bit-identical
    copy of its target (a backend that copies tied weights) is dropped too; an untied
    `lm_head.weight` that differs from the embedding is an ordinary tensor, and a listing
    with the alias alone keeps it.
    """
    seen: dict[tuple, str] = {}  # memory identity -> the name it is kept under
    kept: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        key = _memory_identity(tensor) if tensor.numel() else ("empty", name)  # no memory to share
        first = seen.get(key)
        if first is None:
            seen[key], kept[name] = name, tensor
        elif TIED_ALIASES.get(first) == name:  # the alias came first: the stored name wins
            del kept[first]
            seen[key], kept[name] = name, tensor
        # else: memory already listed under another name, kept once (as named_parameters does)
    for alias, target in TIED_ALIASES.items():
        a, t = kept.get(alias), kept.get(target)
        if a is not None and t is not None and _bit_equal(a, t):
            del kept[alias]
    yield from kept.items()


def checksum_named_tensors(named_tensors: NamedTensors) -> dict[str, str]:
    """name -> blake2b hex digest of the tensor's dtype, shape and raw bytes, over the
    canonical listing (`canonical_named_tensors`), so trainer and engine compare the same
    set of names however each lists tied weights.

    Exact: equal digests mean bit-identical tensors (any dtype, bfloat16 included), so
    `--check-weight-update-equal` can compare trainer and engine weights without tolerances.
    """
    out = {}
    for name, tensor in canonical_named_tensors(named_tensors):
        tensor = tensor.detach().to("cpu").contiguous()
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"{dtype_name(tensor.dtype)}{list(tensor.shape)}".encode())
        # Viewing as bytes needs at least one dim; reshape(-1) also covers 0-d tensors.
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = digest.hexdigest()
    return out


def _memory_identity(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors that view the same elements of the same memory."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().to("cpu").contiguous(), b.detach().to("cpu").contiguous()
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
