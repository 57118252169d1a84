"""A Qwen3 / Llama-family decoder forward over weights held by their HF names.

Weights live in a few fused storages (q|k|v rows in one matrix, gate|up in another) so a
decode step runs two big matmuls per block instead of five; every HF name is a view into
one of them. `update_weights` copies into those views in place, so a captured CUDA graph
replays with the new weights, and `weights_checksum` hashes the same views, so the engine's
weights compare equal to the trainer's HF state dict name by name.

The forward takes packed tokens ([N] ids, any mix of sequences) and an
`attend(layer, qkv) -> out` callback that owns positions and the KV cache: prefill and
decode differ only there (scheduler.py). The callback turns the fused q|k|v rows into
attention inputs either by `attention_inputs` (torch ops) or by `rope_and_store` (one
Triton kernel that also writes the cache; kernels.py).
"""

from __future__ import annotations

import os
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open

from roles.model_spec import ModelSpec
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import dtype_name, unpack_bucket
from roles.weight_views import copy_into

class Weights:
    """The decoder's tensors, fused into storages, exposed by HF name.

    `storages` is what moves on release/resume; `named` maps every HF name (tied
    `lm_head.weight` included, as in the HF state dict) to a view into a storage.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        self.spec = spec
        self.dtype = dtype
        s = spec
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        # name -> (storage key, first row, shape); rows index dim 0 of the storage
        self._layout: dict[str, tuple[str, int, tuple[int, ...]]] = {}
        shapes: dict[str, tuple[int, ...]] = {}

        def add(key: str, parts: list[tuple[str, tuple[int, ...]]]) -> None:
            row = 0
            for name, shape in parts:
                self._layout[name] = (key, row, shape)
                row += shape[0]
            shapes[key] = (row, *parts[0][1][1:])

        add("embed", [("model.embed_tokens.weight", (s.vocab_size, s.hidden_size))])
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            add(f"{i}.qkv", [(p + "self_attn.q_proj.weight", (q, s.hidden_size)),
                             (p + "self_attn.k_proj.weight", (kv, s.hidden_size)),
                             (p + "self_attn.v_proj.weight", (kv, s.hidden_size))])
            if s.qkv_bias:
                add(f"{i}.qkv_bias", [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                                      (p + "self_attn.v_proj.bias", (kv,))])
            add(f"{i}.o", [(p + "self_attn.o_proj.weight", (s.hidden_size, q))])
            if s.qk_norm:
                add(f"{i}.q_norm", [(p + "self_attn.q_norm.weight", (s.head_dim,))])
                add(f"{i}.k_norm", [(p + "self_attn.k_norm.weight", (s.head_dim,))])
            add(f"{i}.gate_up", [(p + "mlp.gate_proj.weight", (s.intermediate_size, s.hidden_size)),
                                 (p + "mlp.up_proj.weight", (s.intermediate_size, s.hidden_size))])
            add(f"{i}.down", [(p + "mlp.down_proj.weight", (s.hidden_size, s.intermediate_size))])
            add(f"{i}.ln1", [(p + "input_layernorm.weight", (s.hidden_size,))])
            add(f"{i}.ln2", [(p + "post_attention_layernorm.weight", (s.hidden_size,))])
        add("norm", [("model.norm.weight", (s.hidden_size,))])
        if s.tied_embeddings:
            self._layout["lm_head.weight"] = self._layout["model.embed_tokens.weight"]
        else:
            add("lm_head", [("lm_head.weight", (s.vocab_size, s.hidden_size))])
        self._shapes = shapes
        self.storages: dict[str, torch.Tensor] = {}
        self.named: dict[str, torch.Tensor] = {}

    # -- storage ----------------------------------------------------------------------
    def allocate(self, device: torch.device) -> None:
        self.set_storages({k: torch.empty(shape, dtype=self.dtype, device=device) for k, shape in self._shapes.items()})

    def set_storages(self, storages: dict[str, torch.Tensor]) -> None:
        """Adopt new storages (after allocate or a move) and rebuild the HF-name views."""
        self.storages = storages
        self.named = {}
        for name, (key, row, shape) in self._layout.items():
            self.named[name] = storages[key][row:row + shape[0]].view(shape)

    def load_checkpoint(self, hf_checkpoint: str) -> None:
        """Fill the storages from the checkpoint's safetensors files, every tensor exactly once."""
        files = sorted(f for f in os.listdir(hf_checkpoint) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"backend 'torch': no *.safetensors files in {hf_checkpoint!r}")
        missing = set(self._layout) - ({"lm_head.weight"} if self.spec.tied_embeddings else set())
        with torch.no_grad():
            for fname in files:
                with safe_open(os.path.join(hf_checkpoint, fname), framework="pt") as f:
                    self.spec.refuse_unplaced(f.keys(), self._layout, loader="backend 'torch'")
                    for name in f.keys():
                        if name not in self._layout:
                            continue  # one the architecture ignores (ModelSpec.ignores)
                        tensor = f.get_tensor(name)
                        target = self.named[name]
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise ValueError(f"backend 'torch': checkpoint tensor {name!r} has shape "
                                             f"{list(tensor.shape)}, config.json implies {list(target.shape)}")
                        target.copy_(tensor)
                        missing.discard(name)
        if missing:
            raise ValueError(f"backend 'torch': checkpoint {hf_checkpoint!r} lacks {sorted(missing)[:5]}")

    # -- weight sync ------------------------------------------------------------------
    def load_bucket(self, bucket: dict) -> int:
        """Copy a bucket's tensors into the views by HF name; every check passes before any write."""
        named = unpack_bucket(bucket)
        for name, tensor in named:
            target = self.named.get(name)
            if target is None:
                raise ValueError(
                    f"update_weights: unknown tensor {name!r}: the model has no parameter or "
                    f"persistent buffer of that name (HF names, e.g. {next(iter(self.named))!r})"
                )
            if list(tensor.shape) != list(target.shape):
                raise ValueError(f"update_weights: tensor {name!r} has shape {list(tensor.shape)}, "
                                 f"the model's is {list(target.shape)}")
            if tensor.dtype != target.dtype:
                raise ValueError(f"update_weights: tensor {name!r} has dtype {dtype_name(tensor.dtype)}, "
                                 f"the model's is {dtype_name(target.dtype)}; cast on the sender")
        with torch.no_grad():
            # in place (graphs captured over these views see it); copy_into batches the small
            # tensors of a ~400-tensor bucket into one launch, copies each large one by a memcpy,
            # and puts q/k/v windows (LazyReshape) into the views reshaped to the window's shape
            copy_into([self.named[name] for name, _ in named], [tensor for _, tensor in named])
        return len(named)

    def checksum(self) -> dict[str, str]:
        return checksum_named_tensors(self.named.items())


class Decoder:
    """The forward pass. `build_rope(length)` precomputes cos/sin once per device.

    `compile_ops=True` runs the elementwise pieces (norms, rope, SwiGLU, residual adds)
    through torch.compile with dynamic shapes: fused kernels instead of ~50 small ones per
    block, which a decode step at small batch is otherwise bound by. Same math; on the CPU
    and in the tests it stays off.
    """

    def __init__(self, weights: Weights, *, compile_ops: bool = False):
        self.w = weights
        self.spec = weights.spec
        self.cos = self.sin = None  # [T, D] in the model dtype
        ops = (_rms_norm, _add_rms_norm, _attention_inputs, _swiglu)
        if compile_ops:
            import torch._inductor.config

            # a handful of small kernels: compile them in-process rather than in a pool of
            # worker processes that would outlive the call as children of this role
            torch._inductor.config.compile_threads = 1
            ops = tuple(torch.compile(op, dynamic=True) for op in ops)
        self._norm, self._add_norm, self._attention_inputs, self._swiglu = ops

    def build_rope(self, length: int, device: torch.device) -> None:
        """cos/sin [length, D] for positions [0, length), from roles.rope's tables: the same
        values in both halves, which is how `_attention_inputs` and the Triton kernel read them."""
        if self.cos is not None and self.cos.shape[0] >= length and self.cos.device == device:
            return
        cos, sin = self.spec.rope.tables(torch.arange(length, device=device), self.w.dtype)
        self.cos, self.sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def drop_rope(self) -> None:
        self.cos = self.sin = None

    def forward(
        self,
        tokens: torch.Tensor,  # [N] int64
        attend: Callable[[int, torch.Tensor], torch.Tensor],  # (layer, qkv [N, (H + 2KV) D]) -> [N, H, D]
    ) -> torch.Tensor:  # [N, hidden], final-normed
        s, st = self.spec, self.w.storages
        n = tokens.shape[0]
        x = F.embedding(tokens, st["embed"])
        h = self._norm(x, st["0.ln1"], s.norm_eps)
        for i in range(s.num_layers):
            out = attend(i, F.linear(h, st[f"{i}.qkv"], st.get(f"{i}.qkv_bias")))  # [N, H, D]
            x, h = self._add_norm(x, F.linear(out.reshape(n, -1), st[f"{i}.o"]), st[f"{i}.ln2"], s.norm_eps)
            down = F.linear(self._swiglu(F.linear(h, st[f"{i}.gate_up"])), st[f"{i}.down"])
            following = st[f"{i + 1}.ln1"] if i + 1 < s.num_layers else st["norm"]
            x, h = self._add_norm(x, down, following, s.norm_eps)
        return h

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [N, D] at the tokens' positions, for `attention_inputs`."""
        return self.cos[positions], self.sin[positions]

    def attention_inputs(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, H, D], k and v [N, KV, D] of one layer: per-head norms (Qwen3), then rope."""
        s, st = self.spec, self.w.storages
        return self._attention_inputs(qkv, cos, sin, st.get(f"{layer}.q_norm"), st.get(f"{layer}.k_norm"),
                                      s.num_heads, s.num_kv_heads, s.norm_eps)

    def rope_and_store(self, layer: int, qkv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """`attention_inputs` fused with the cache write, by one Triton kernel: returns q; k and v
        go to keys/values[slots[n], :, positions[n]] ([S, KV, T, D] each)."""
        from roles.rollout.torch_engine.kernels import rope_and_store

        s, st = self.spec, self.w.storages
        return rope_and_store(qkv, self.cos, self.sin, st.get(f"{layer}.q_norm"), st.get(f"{layer}.k_norm"),
                              positions, slots, keys, values, num_heads=s.num_heads,
                              num_kv_heads=s.num_kv_heads, eps=s.norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] float32
        return F.linear(hidden, self.w.named["lm_head.weight"]).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order of operations (fp32 statistics, cast back, then scale) for equal outputs
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: (x + delta, norm(x + delta))."""
    x = x + delta
    return x, _rms_norm(x, weight, eps)


def _attention_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, num_heads: int, num_kv_heads: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split fused q|k|v rows into heads, apply Qwen3's per-head norms, then rope to q and k."""
    n, head_dim = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, num_heads, head_dim), k.view(n, num_kv_heads, head_dim), v.view(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = _rms_norm(q, q_norm, eps), _rms_norm(k, k_norm, eps)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v.contiguous()


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
