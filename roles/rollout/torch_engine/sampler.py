"""Next-token sampling on the device, with a counter-based RNG.

Semantics are those of roles/rollout/sampling.py (greedy below GREEDY_EPS, top-k then
top-p on the temperature-scaled distribution, log-prob of the sampled token BEFORE the
cut). The random draw is one uniform per (request seed, position of the sampled token),
computed by hashing those two integers: no generator state, so the whole step runs inside a
CUDA graph (seeds and positions are tensors the graph reads).

A token is drawn by inverting the CDF of the (cut) distribution, in vocabulary order, at that
uniform. Given a row's logits, its token does not depend on the other rows of the call, nor
on the mode the call runs in (`sample`); nor does its log-prob, bit for bit on the CPU, to an
ulp or two on a GPU (CUDA's reductions over the vocabulary depend on the call's rows: the
H200 showed 1 ulp). Whether the logits depend on the batch is
the forward's matter: in fp32 they do not, so a seeded request's tokens are the same alone and
in any batch, whatever its sampling modes (tests/test_rollout_batch_invariance.py, CPU and
GPU); in bf16 on a GPU the batch changes the matmul and attention shapes, hence the rounding,
and a near tie may flip (9 of 64 requests in issue 22's probe, batch 64 against alone), unless
the backend's batch_invariant option fixes those shapes (backend.py; the same test file holds
it to bitwise equality on the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from roles.rollout.sampling import SamplingParams

_M32 = 0xFFFFFFFF


@dataclass
class SamplingRows:
    """Per-row sampling parameters as device tensors ([B] each)."""

    temperature: torch.Tensor  # float32; 1.0 for greedy rows (their log-probs use T = 1)
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # int64; vocab size when disabled
    top_p: torch.Tensor  # float32; inf when disabled (float rounding can push the mass past 1)
    seed: torch.Tensor  # int64, >= 0

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], vocab: int, device) -> SamplingRows:
        return cls(
            temperature=torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device),
            greedy=torch.tensor([p.greedy for p in params], device=device),
            top_k=torch.tensor([vocab if p.top_k == -1 else p.top_k for p in params], device=device),
            top_p=torch.tensor([p.top_p if p.top_p < 1 else float("inf") for p in params], device=device),
            seed=torch.tensor([s % (1 << 63) for s in seeds], dtype=torch.long, device=device),
        )

    @classmethod
    def empty(cls, n: int, vocab: int, device) -> SamplingRows:
        return cls.build([SamplingParams()] * n, [0] * n, vocab, device)

    def assign(self, rows: torch.Tensor, other: SamplingRows) -> None:
        """self[rows] = other, in place (graphs read these tensors' storage)."""
        for name in ("temperature", "greedy", "top_k", "top_p", "seed"):
            getattr(self, name)[rows] = getattr(other, name)

    def head(self, n: int) -> SamplingRows:
        return SamplingRows(self.temperature[:n], self.greedy[:n], self.top_k[:n], self.top_p[:n], self.seed[:n])


MODES = ("greedy", "plain", "cut")


def sampling_mode(params: list[SamplingParams]) -> str:
    """The cheapest `sample` mode that serves every request of a call.

    "greedy": all rows greedy (no draw); "cut": some row uses top-k/top-p (the sampler sorts
    the vocabulary); "plain": neither.
    """
    if all(p.greedy for p in params):
        return "greedy"
    return "cut" if any(not p.greedy and (p.top_k != -1 or p.top_p < 1) for p in params) else "plain"


def sample(
    logits: torch.Tensor,  # [B, V] float32
    rows: SamplingRows,  # [B] each
    positions: torch.Tensor,  # [B] int64: the position the sampled token will take
    *,
    mode: str,  # sampling_mode of the rows
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B] int64, logprobs [B] float32
    """Each row's token and log-prob are computed the same way in every mode that serves it,
    so they do not depend on the other rows of the call: a greedy row's by the argmax and the
    log-softmax at T = 1 (dividing by 1 changes no bit); a sampling row's by inverting its CDF
    in vocabulary order, after zeroing what its top-k/top-p cuts ("cut" mode; a row that cuts
    nothing keeps its probabilities as they are, so it draws the token "plain" mode draws)."""
    scaled = logits if mode == "greedy" else logits / rows.temperature[:, None]  # T = 1 on greedy rows
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    tokens = logits.argmax(dim=-1)
    if mode != "greedy":
        probs = logprobs.exp()
        if mode == "cut":
            probs = probs.masked_fill(_cut(probs, rows), 0.0)
        tokens = torch.where(rows.greedy, tokens, _invert_blocked(probs, uniform(rows.seed, positions)))
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]


def _cut(probs: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """[B, V] bool in vocabulary order: the tokens top-k, then top-p, leave out."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    drop = (rank >= rows.top_k[:, None]) | (mass_before > rows.top_p[:, None])
    return torch.empty_like(drop).scatter_(1, order, drop)


def _invert_blocked(probs: torch.Tensor, u: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The first index whose cumulative mass exceeds u * total, in two levels: block sums,
    then one block's prefix. Zero-mass tokens (cut ones, the padding) are never drawn, even
    where the two levels' sums round apart.

    A scan over the whole vocabulary is one slow kernel (0.25 ms a decode step at Qwen's
    152k vocabulary and batch 64); sums of 128-token blocks and two short scans are not.
    """
    rows, vocab = probs.shape
    pad = -vocab % block
    blocks = F.pad(probs, (0, pad)).view(rows, -1, block)  # [B, nb, block]
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)  # [B, nb]
    target = (u * block_cdf[:, -1]).unsqueeze(1).contiguous()  # [B, 1]
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [B, 1]
    before = torch.where(b > 0, block_cdf.gather(1, (b - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, b[:, :, None].expand(rows, 1, block))[:, 0].cumsum(dim=-1)  # [B, block]
    last = (inner < inner[:, -1:]).sum(dim=-1, keepdim=True)  # [B, 1]: the block's last token of mass > 0
    within = (target - before).clamp(min=0).contiguous()  # >= 0: a leading zero-mass token is passed over
    i = torch.searchsorted(inner, within, right=True).minimum(last)
    return (b * block + i)[:, 0]


def uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A float32 uniform in [0, 1) per (seed, position): murmur3's 32-bit finaliser, chained.

    int64 arithmetic holding 32-bit values: products wrap, and the low 32 bits kept are the
    same as unsigned 32-bit arithmetic would give, on CPU and CUDA alike.
    """
    h = _fmix32((seeds & _M32) ^ _fmix32((seeds >> 32) + 0x9E3779B9))
    h = _fmix32(h ^ ((positions * 0x9E3779B1) & _M32))
    return (h >> 8).float() * (1.0 / (1 << 24))


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)

