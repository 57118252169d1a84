"""HF <-> megatron-core weight mapping on state dicts, pure torch (runs without megatron).

Megatron names are those of GPTModel built with megatron's local layer spec (`spec="local"`)
or transformer-engine's (`spec="te"`); they differ only where TE fuses the norm into the
next linear:

    local                                   te
    decoder.layers.i.input_layernorm.weight   decoder.layers.i.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.i.pre_mlp_layernorm.weight decoder.layers.i.mlp.linear_fc1.layer_norm_weight

Layouts (megatron's, per tensor-parallel rank r of tp):
    linear_qkv   [groups/tp * (q_per_group + 2) * d, H]: for each query group of rank r,
                 its q heads, then its k head, then its v head
    linear_fc1   [2 * F/tp, H]: rank r's slice of gate, then rank r's slice of up
    linear_proj, linear_fc2       row parallel: split along dim 1
    word_embeddings, output_layer vocab parallel: split along dim 0 (vocab padded to tp)
    norms, q/k layernorm, critic's value head   replicated
Layer i of pipeline stage s is global layer s * L/pp + i (even stages).

The critic (`critic=True`) is the trunk plus a value head: HF side `backbone.<AutoModel
name>` and `value_head.{weight,bias}` (roles.trainer.torch.model.ValueModel), megatron side
`output_layer.{weight,bias}` of shape [1, H] and [1].
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from roles.model_spec import ModelSpec
from roles.weight_views import LazyReshape

SPECS = ("local", "te")

_NORM_NAMES = {
    "local": {"input": "input_layernorm.weight", "pre_mlp": "pre_mlp_layernorm.weight"},
    "te": {"input": "self_attention.linear_qkv.layer_norm_weight", "pre_mlp": "mlp.linear_fc1.layer_norm_weight"},
}


def _hf_prefix(critic: bool) -> tuple[str, str]:
    """(prefix of the decoder's names, name of the embedding) on the HF side."""
    trunk = "backbone." if critic else "model."
    return trunk, f"{trunk}embed_tokens.weight"


def megatron_names(shape: ModelSpec, *, pp_rank: int, pp_size: int, spec: str = "local",
                   critic: bool = False) -> list[str]:
    """Parameter names of one pipeline stage's GPTModel, in the order this module emits them."""
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}, expected one of {SPECS}")
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    names = ["embedding.word_embeddings.weight"] if first else []
    norms = _NORM_NAMES[spec]
    for i in range(shape.num_layers // pp_size):
        p = f"decoder.layers.{i}."
        names.append(p + norms["input"])
        names.append(p + "self_attention.linear_qkv.weight")
        if shape.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if shape.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + norms["pre_mlp"],
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    if last:
        names.append("decoder.final_layernorm.weight")
        if critic:
            names += ["output_layer.weight", "output_layer.bias"]
        elif not shape.tied_embeddings or not first:
            # Tied and pipelined: the last stage keeps its own copy of the embedding (megatron's
            # shared_embedding), kept equal by an all-reduce of their grads.
            names.append("output_layer.weight")
    return names


def _layer_parts(local: str) -> tuple[int, str]:
    """'decoder.layers.3.mlp.linear_fc1.weight' -> (3, 'mlp.linear_fc1.weight')."""
    rest = local[len("decoder.layers."):]
    index, _, tail = rest.partition(".")
    return int(index), tail


def hf_sources(name: str, shape: ModelSpec, *, layer_offset: int, spec: str = "local",
               critic: bool = False) -> list[str]:
    """The HF tensors a megatron parameter is made of (several for fused ones)."""
    trunk, embed = _hf_prefix(critic)
    if name == "embedding.word_embeddings.weight":
        return [embed]
    if name == "decoder.final_layernorm.weight":
        return [f"{trunk}norm.weight"]
    if name == "output_layer.weight":
        if critic:
            return ["value_head.weight"]
        return [embed] if shape.tied_embeddings else ["lm_head.weight"]
    if name == "output_layer.bias":
        return ["value_head.bias"]
    index, tail = _layer_parts(name)
    p = f"{trunk}layers.{index + layer_offset}."
    table = _LAYER_TABLES[spec]
    if tail not in table:
        raise KeyError(f"megatron parameter {name!r} has no HF counterpart in this mapper")
    return [p + t for t in table[tail]]


# megatron name within a layer -> the HF names within a layer it is made of, per spec (built once:
# the weight sync maps every parameter on every sync)
_LAYER_TABLES = {
    spec: {
        norms["input"]: ["input_layernorm.weight"],
        norms["pre_mlp"]: ["post_attention_layernorm.weight"],
        "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"],
        "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
        "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
        "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    }
    for spec, norms in _NORM_NAMES.items()
}


def _kind(name: str, critic: bool) -> str:
    """How a parameter is split across tensor-parallel ranks."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        return "qkv"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        return "row"
    if name == "embedding.word_embeddings.weight" or (name == "output_layer.weight" and not critic):
        return "vocab"
    return "replicated"


def to_megatron(name: str, hf: Mapping[str, torch.Tensor], shape: ModelSpec, *, tp_rank: int, tp_size: int,
                layer_offset: int, spec: str = "local", critic: bool = False) -> torch.Tensor:
    """Rank tp_rank's shard of megatron parameter `name`, built from HF tensors (a new tensor)."""
    sources = [hf[n] for n in hf_sources(name, shape, layer_offset=layer_offset, spec=spec, critic=critic)]
    kind = _kind(name, critic)
    if kind == "qkv":
        q, k, v = sources
        d, g, qpg = shape.head_dim, shape.num_kv_heads, shape.heads_per_group
        rest = q.shape[1:]  # (H,) for weights, () for biases
        fused = torch.cat([q.reshape(g, qpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest).clone()
    if kind == "fc1":
        gate, up = sources
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    (src,) = sources
    if kind == "row":
        return src.chunk(tp_size, dim=1)[tp_rank].clone()
    if kind == "vocab":
        padded = shape.padded_vocab(tp_size)
        if padded != src.shape[0]:
            src = torch.cat([src, src.new_zeros(padded - src.shape[0], *src.shape[1:])])
        return src.chunk(tp_size, dim=0)[tp_rank].clone()
    return src.clone()


def to_hf(name: str, shards: list[torch.Tensor], shape: ModelSpec, *, layer_offset: int, spec: str = "local",
          critic: bool = False, views: bool = False) -> list[tuple[str, torch.Tensor | LazyReshape]]:
    """HF (name, tensor) pairs of megatron parameter `name`, from its shards of every TP rank
    in rank order. The HF tensors of the tied output layer are left out (the embedding
    carries them). With one shard every tensor but q/k/v is a view of the shard (no copy):
    callers that keep or modify them copy first.

    q/k/v are copies (their rows interleave per query group: no view of the fused parameter
    has the HF shape), except that with `views` and one shard they come as LazyReshapes of
    the strided windows [groups, rows per group, *rest] (roles.weight_views: the weight sync,
    which sends them unpacked); at TP>1 the windows would be of a gathered temporary, so they
    are copies there too."""
    targets = hf_sources(name, shape, layer_offset=layer_offset, spec=spec, critic=critic)
    kind = _kind(name, critic)
    if name == "output_layer.weight" and not critic and shape.tied_embeddings:
        return []
    if kind == "qkv":
        d, qpg = shape.head_dim, shape.heads_per_group
        full = _cat(shards, dim=0)
        rest = full.shape[1:]
        grouped = full.reshape(shape.num_kv_heads, (qpg + 2) * d, *rest)
        windows = [LazyReshape(x, (x.shape[0] * x.shape[1], *rest)) for x in grouped.split([qpg * d, d, d], dim=1)]
        lazy = views and len(shards) == 1
        # else the one copy of the mapping (a view where one exists: a single query group)
        return [(t, w if lazy else w.materialize()) for t, w in zip(targets, windows)]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        gate = _cat([h[0] for h in halves], dim=0)
        up = _cat([h[1] for h in halves], dim=0)
        return [(targets[0], gate), (targets[1], up)]
    if kind == "row":
        return [(targets[0], _cat(shards, dim=1))]
    if kind == "vocab":
        rows = _cat(shards, dim=0)[: shape.vocab_size]
        if len(shards) > 1 and rows.shape[0] < sum(s.shape[0] for s in shards):
            # a slice of the gathered temporary would look like a window into a persistent
            # buffer (roles.weight_sync.is_window) and keep the whole gather alive in a sync
            rows = rows.clone()
        return [(targets[0], rows)]
    return [(targets[0], shards[0])]


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that one part is returned as is: at TP1 the HF tensors of
    fc1, linear_proj/fc2, the embedding and the norms are views of megatron's parameters,
    so the weight sync reads them without an intermediate copy."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def layer_offset(shape: ModelSpec, *, pp_rank: int, pp_size: int) -> int:
    """Global index of pipeline stage pp_rank's first layer (even stages)."""
    return pp_rank * (shape.num_layers // pp_size)


def unplaced_problem(names, shape: ModelSpec, *, critic: bool = False) -> str | None:
    """Which HF tensor among `names` no parameter of the whole model is made of (those the
    architecture drops aside: ModelSpec.ignores), as a sentence; None if none."""
    placed = {src for name in megatron_names(shape, pp_rank=0, pp_size=1, critic=critic)
              for src in hf_sources(name, shape, layer_offset=0, critic=critic)}
    unplaced = sorted(n for n in names if n not in placed and not shape.ignores(n))
    if not unplaced:
        return None
    more = f" and {len(unplaced) - 1} more" if len(unplaced) > 1 else ""
    return (f"checkpoint tensor {unplaced[0]!r}{more} has no place in the {shape.model_type} model its config "
            f"describes (qkv_bias={shape.qkv_bias}, qk_norm={shape.qk_norm}, tied_embeddings={shape.tied_embeddings}): "
            "the checkpoint and its config.json disagree")


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelSpec, *, tp_rank: int, tp_size: int,
                   pp_rank: int, pp_size: int, spec: str = "local", critic: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of one (TP rank, PP stage) GPTModel from a full HF state dict. A tensor
    the model has no place for is refused by name rather than dropped (unplaced_problem)."""
    shape.check_parallel(tp_size=tp_size, pp_size=pp_size)
    problem = unplaced_problem(hf, shape, critic=critic)
    if problem:
        raise ValueError(problem)
    offset = layer_offset(shape, pp_rank=pp_rank, pp_size=pp_size)
    return {
        name: to_megatron(name, hf, shape, tp_rank=tp_rank, tp_size=tp_size, layer_offset=offset, spec=spec,
                          critic=critic)
        for name in megatron_names(shape, pp_rank=pp_rank, pp_size=pp_size, spec=spec, critic=critic)
    }


def stage_to_hf(shards: Callable[[str], list[torch.Tensor]], shape: ModelSpec, *, pp_rank: int, pp_size: int,
                spec: str = "local", critic: bool = False,
                views: bool = False) -> Iterator[tuple[str, torch.Tensor | LazyReshape]]:
    """HF (name, tensor) pairs of one pipeline stage, in megatron_names' order, its layers
    under their global indices. `shards(name)` gives a parameter's shards of every TP rank in
    rank order; it is called lazily, one parameter at a time (a caller may all-gather there).
    Meta tensors give the names, shapes and dtypes without data. `views`: as `to_hf`'s."""
    offset = layer_offset(shape, pp_rank=pp_rank, pp_size=pp_size)
    for name in megatron_names(shape, pp_rank=pp_rank, pp_size=pp_size, spec=spec, critic=critic):
        yield from to_hf(name, shards(name), shape, layer_offset=offset, spec=spec, critic=critic, views=views)


def megatron_to_hf(states: list[list[Mapping[str, torch.Tensor]]], shape: ModelSpec, *, spec: str = "local",
                   critic: bool = False) -> dict[str, torch.Tensor]:
    """A full HF state dict from states[pp_rank][tp_rank] of every rank of the model."""
    out: dict[str, torch.Tensor] = {}
    for pp_rank, tp_states in enumerate(states):
        out.update(stage_to_hf(lambda name, tp_states=tp_states: [s[name] for s in tp_states], shape,
                               pp_rank=pp_rank, pp_size=len(states), spec=spec, critic=critic))
    return out
