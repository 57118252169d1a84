"""A Qwen3 / Llama-family decoder forward over weights held by their HF names.

Weights live in a few fused storages (q|k|v rows in one matrix, gate|up in another) so a
decode step runs two big matmuls per block instead of five; every HF name is a view into
one of them. `update_weights` copies into those views in place, so a captured CUDA graph
replays with the new weights, and `weights_checksum` hashes the same views, so the engine's
weights compare equal to the trainer's HF state dict name by name.

The forward takes packed tokens ([N] ids and positions, any mix of sequences) and an
`attend(layer, q, k, v) -> out` callback that owns the KV cache: prefill and decode differ
only there (scheduler.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from safetensors import safe_open

from roles.weight_sync import checksum_named_tensors, dtype_name, unpack_bucket

FAMILIES = ("qwen3", "qwen2", "llama", "mistral")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shapes a forward needs, read from an HF config.json."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rms_eps: float
    tied: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before rope
    qkv_bias: bool  # Qwen2 has q/k/v biases
    eos_ids: tuple[int, ...]
    pad_id: int

    @classmethod
    def from_checkpoint(cls, hf_checkpoint: str) -> ModelSpec:
        with open(os.path.join(hf_checkpoint, "config.json")) as f:
            cfg = json.load(f)
        family = cfg.get("model_type")
        if family not in FAMILIES:
            raise ValueError(f"backend 'torch': model_type={family!r} is not supported; supported: {FAMILIES}")
        if cfg.get("use_sliding_window"):
            raise ValueError("backend 'torch': use_sliding_window=True is not supported (full attention only)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"backend 'torch': hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")
        eos = _generation_eos(hf_checkpoint, cfg.get("eos_token_id"))
        heads = cfg["num_attention_heads"]
        return cls(
            num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
            max_positions=cfg["max_position_embeddings"], rms_eps=cfg["rms_norm_eps"],
            tied=bool(cfg.get("tie_word_embeddings", False)), qk_norm=family == "qwen3",
            qkv_bias=bool(cfg.get("attention_bias", family == "qwen2")), eos_ids=eos,
            pad_id=cfg.get("pad_token_id") or 0,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache elements per token (all layers, K and V); times the dtype's itemsize for bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _generation_eos(hf_checkpoint: str, config_eos) -> tuple[int, ...]:
    path = os.path.join(hf_checkpoint, "generation_config.json")
    eos = config_eos
    if os.path.exists(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    return tuple([eos] if isinstance(eos, int) else eos or [])


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

        add("embed", [("model.embed_tokens.weight", (s.vocab, s.hidden))])
        for i in range(s.num_layers):
            p = f"model.layers.{i}."
            add(f"{i}.qkv", [(p + "self_attn.q_proj.weight", (q, s.hidden)),
                             (p + "self_attn.k_proj.weight", (kv, s.hidden)),
                             (p + "self_attn.v_proj.weight", (kv, s.hidden))])
            if s.qkv_bias:
                add(f"{i}.qkv_bias", [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                                      (p + "self_attn.v_proj.bias", (kv,))])
            add(f"{i}.o", [(p + "self_attn.o_proj.weight", (s.hidden, q))])
            if s.qk_norm:
                add(f"{i}.q_norm", [(p + "self_attn.q_norm.weight", (s.head_dim,))])
                add(f"{i}.k_norm", [(p + "self_attn.k_norm.weight", (s.head_dim,))])
            add(f"{i}.gate_up", [(p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
                                 (p + "mlp.up_proj.weight", (s.intermediate, s.hidden))])
            add(f"{i}.down", [(p + "mlp.down_proj.weight", (s.hidden, s.intermediate))])
            add(f"{i}.ln1", [(p + "input_layernorm.weight", (s.hidden,))])
            add(f"{i}.ln2", [(p + "post_attention_layernorm.weight", (s.hidden,))])
        add("norm", [("model.norm.weight", (s.hidden,))])
        if s.tied:
            self._layout["lm_head.weight"] = self._layout["model.embed_tokens.weight"]
        else:
            add("lm_head", [("lm_head.weight", (s.vocab, s.hidden))])
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
        missing = set(self._layout) - ({"lm_head.weight"} if self.spec.tied else set())
        with torch.no_grad():
            for fname in files:
                with safe_open(os.path.join(hf_checkpoint, fname), framework="pt") as f:
                    for name in f.keys():
                        if name not in self._layout:
                            if name.endswith("rotary_emb.inv_freq"):
                                continue  # old checkpoints store the rope buffer; we compute it
                            raise ValueError(f"backend 'torch': checkpoint tensor {name!r} has no place in the decoder")
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
            for name, tensor in named:
                self.named[name].copy_(tensor)  # in place: graphs captured over these views see it
        return len(named)

    def checksum(self) -> dict[str, str]:
        return checksum_named_tensors(self.named.items())


class Decoder:
    """The forward pass. `rope_table(length)` positions are precomputed once per device."""

    def __init__(self, weights: Weights, rope_inv_freq: torch.Tensor, rope_scaling: float):
        self.w = weights
        self.spec = weights.spec
        self._inv_freq = rope_inv_freq  # [D/2] float32, as HF's rotary embedding computes it
        self._rope_scaling = rope_scaling
        self.cos = self.sin = None  # [T, D] in the model dtype

    def build_rope(self, length: int, device: torch.device) -> None:
        """cos/sin for positions [0, length): HF's formula (fp32 product, then the model dtype)."""
        if self.cos is not None and self.cos.shape[0] >= length and self.cos.device == device:
            return
        freqs = torch.arange(length, device=device).float()[:, None] * self._inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self._rope_scaling).to(self.w.dtype)
        self.sin = (emb.sin() * self._rope_scaling).to(self.w.dtype)

    def drop_rope(self) -> None:
        self.cos = self.sin = None

    def forward(
        self,
        tokens: torch.Tensor,  # [N] int64
        positions: torch.Tensor,  # [N] int64
        attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:  # [N, hidden], final-normed
        s, st = self.spec, self.w.storages
        n = tokens.shape[0]
        x = F.embedding(tokens, st["embed"])
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [N, 1, D]
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i in range(s.num_layers):
            h = _rms_norm(x, st[f"{i}.ln1"], s.rms_eps)
            qkv = F.linear(h, st[f"{i}.qkv"], st.get(f"{i}.qkv_bias"))  # [N, (H + 2KV) D]
            q = qkv[:, :q_size].view(n, s.num_heads, s.head_dim)
            k = qkv[:, q_size:q_size + kv_size].view(n, s.num_kv_heads, s.head_dim)
            v = qkv[:, q_size + kv_size:].view(n, s.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = _rms_norm(q, st[f"{i}.q_norm"], s.rms_eps)
                k = _rms_norm(k, st[f"{i}.k_norm"], s.rms_eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            out = attend(i, q, k, v)  # [N, H, D]
            x = x + F.linear(out.reshape(n, q_size), st[f"{i}.o"])
            h = _rms_norm(x, st[f"{i}.ln2"], s.rms_eps)
            gate, up = F.linear(h, st[f"{i}.gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, st[f"{i}.down"])
        return _rms_norm(x, st["norm"], s.rms_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, V] float32
        return F.linear(hidden, self.w.named["lm_head.weight"]).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's order of operations (fp32 statistics, cast back, then scale) for equal outputs
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_parameters(hf_checkpoint: str) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention scaling) exactly as transformers computes them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(hf_checkpoint)
    params = getattr(config, "rope_parameters", None) or {"rope_type": "default",
                                                          "rope_theta": getattr(config, "rope_theta", 10000.0)}
    kind = params.get("rope_type", "default")
    if kind == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"backend 'torch': rope_type={kind!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(scaling)
