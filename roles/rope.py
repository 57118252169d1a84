"""Rotary position embedding: the frequencies and cos/sin tables of every backend.

The engine's decoder (torch ops and the Triton `rope_and_store` kernel) and the megatron
trainer's core attention (an autograd Function) build their tables here, so they rotate by the
same numbers; the torch trainer runs transformers' own RoPE, which `inv_freq` reproduces
(tests/test_rope.py holds it to transformers' ROPE_INIT_FUNCTIONS). Which scalings a model may
ask for is decided in roles.model_spec, which builds `Rope` from the HF config.

Numerics, as transformers computes them: inv_freq in float32 on the CPU; on the device
freqs = position x inv_freq in float32, cos/sin times the scaling's attention factor (YaRN's
mscale; 1 otherwise) in float32, then cast to the compute dtype. Both consumers rotate
non-interleaved halves (rotate_half), each product rounded to the tensor's dtype before the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a spec is read without torch (the memory plan of launch.py --dry-run)
    import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(kw_only=True, frozen=True)
class Rope:
    """One model's RoPE. `kind` "default" uses theta and head_dim only; the other fields are
    the scaling's parameters under their HF names (rope_parameters / rope_scaling)."""

    theta: float
    head_dim: int
    kind: str = "default"
    factor: float = 1.0  # linear, llama3, yarn
    original_max_position_embeddings: int = 0  # llama3, yarn: the pretraining context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    attention_factor: float = 1.0  # yarn: cos/sin scale (mscale); 1 for the others

    def __post_init__(self):
        if not self.theta > 0:
            raise ValueError(f"Rope.theta={self.theta!r}, expected > 0")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"Rope.head_dim={self.head_dim!r}, expected an even number >= 2")
        if self.kind not in ROPE_TYPES:
            raise ValueError(f"Rope.kind={self.kind!r}, expected one of {ROPE_TYPES}")
        if self.kind in ("llama3", "yarn") and self.original_max_position_embeddings < 1:
            raise ValueError(f"Rope.original_max_position_embeddings={self.original_max_position_embeddings!r} "
                             f"with kind={self.kind!r}, expected >= 1")

    def inv_freq(self) -> torch.Tensor:
        """[head_dim / 2] float32, as transformers' ROPE_INIT_FUNCTIONS[kind] computes it: on the
        CPU, so every backend rotates by the very numbers of the HF model (a device's pow may
        round differently)."""
        import torch

        d = self.head_dim
        wave = self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # theta^(2i/d)
        if self.kind == "linear":
            return 1.0 / wave / self.factor
        if self.kind == "llama3":
            return self._llama3(1.0 / wave)
        if self.kind == "yarn":
            return self._yarn(wave)
        return 1.0 / wave

    def _llama3(self, inv_freq: torch.Tensor) -> torch.Tensor:
        # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = (inv_freq / self.factor).where(wavelen > low_wavelen, inv_freq)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return smoothed.where(medium, scaled)

    def _yarn(self, wave: torch.Tensor) -> torch.Tensor:
        # YaRN: interpolate (divide by factor) the dimensions that rotate less than beta_slow times
        # over the pretraining context, extrapolate (keep) those above beta_fast, ramp between
        d, old = self.head_dim, self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:
            return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((wave.new_tensor(range(d // 2)) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        return (1.0 / (self.factor * wave)) * (1 - extrapolation) + (1.0 / wave) * extrapolation

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [len(positions), head_dim / 2] in `dtype`, on the positions' device:
        float32 freqs and attention factor, then the cast."""
        # a copy staged from pageable memory: the host does not wait for the device's queue
        inv_freq = self.inv_freq().to(positions.device, non_blocking=True)
        freqs = positions.float().outer(inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` times the pretraining one (paper eq. 21)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
