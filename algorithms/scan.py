"""Discounted suffix sums over the valid tokens of a masked batch, vectorised.

The recurrence behind GAE and REINFORCE++ returns is

    y[t] = x[t] + decay * y[next valid position after t]    at valid t
    y[t] = y[next valid position after t]                   at masked t

with y = 0 past the last valid token. Masked positions (tool output, padding) are
skipped, not counted as steps: they carry the next valid result backward and
contribute nothing. Unrolled, y[t] = sum over valid s >= t of decay**n(t, s) * x[s],
where n(t, s) counts the valid positions in [t, s).
"""

import math

import torch

# decay**k is used for k up to a chunk's length, in both directions; this bound on
# |k * ln(decay)| keeps both factors well inside float32 range (e**40 ~ 2e17).
_MAX_LOG_SCALE = 40.0
_MAX_CHUNK = 512


def next_valid_index(valid: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """[B, T] int64: index of the first valid position >= t (inclusive) or > t, else T."""
    batch, length = valid.shape
    positions = torch.arange(length, device=valid.device).expand(batch, length)
    idx = torch.where(valid, positions, length)
    first_from = idx.flip(-1).cummin(-1).values.flip(-1)  # min over s >= t
    if inclusive:
        return first_from
    return torch.cat([first_from[:, 1:], idx.new_full((batch, 1), length)], dim=1)


def chunk_length(decay: float) -> int:
    """Largest chunk for which decay**(+-chunk) stays representable, capped at _MAX_CHUNK."""
    if decay == 1.0:
        return _MAX_CHUNK
    return max(1, min(_MAX_CHUNK, int(_MAX_LOG_SCALE / -math.log(decay))))


def masked_discounted_cumsum(x: torch.Tensor, valid: torch.Tensor, decay: float) -> torch.Tensor:
    """y as in the module docstring for x [B, T] (zero at masked positions), valid [B, T] bool.

    Chunked scan: inside a chunk of C positions y is a reverse cumsum of x rescaled by
    decay**(valid count), all chunks at once; a loop over the T / C chunks then
    carries each chunk's head value into the chunk before it. Differentiable.
    """
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    batch, length = x.shape
    if length == 0:
        return x.clone()
    if decay == 0.0:
        # Only the next valid token's own x survives.
        padded = torch.cat([x, x.new_zeros(batch, 1)], dim=1)
        return padded.gather(1, next_valid_index(valid, inclusive=True))
    if decay == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)

    chunk = chunk_length(decay)
    num_chunks = -(-length // chunk)
    pad = num_chunks * chunk - length
    xs = torch.nn.functional.pad(x, (0, pad)).view(batch, num_chunks, chunk)
    vs = torch.nn.functional.pad(valid, (0, pad)).view(batch, num_chunks, chunk).long()

    # decay**k and decay**-k for every count a chunk can hold, rounded once from
    # float64: exp(k * ln(decay)) in float32 is off by about k * |ln(decay)| ulps.
    exponents = torch.arange(chunk + 1, dtype=torch.float64, device=x.device)
    power = (decay**exponents).to(x.dtype)
    inverse_power = (decay**-exponents).to(x.dtype)

    before = vs.cumsum(-1) - vs  # valid positions in [chunk start, t)   [B, N, C]
    in_chunk = vs.sum(-1, keepdim=True)  # valid positions in the chunk   [B, N, 1]
    scaled_suffix = (xs * power[before]).flip(-1).cumsum(-1).flip(-1)
    local = scaled_suffix * inverse_power[before]  # y with nothing after the chunk

    # head[c] = y at the first position of chunk c; the chunk before it sees it
    # through decay**(valid positions between t and the end of its own chunk).
    chunk_decay = power[in_chunk.squeeze(-1)]  # [B, N]
    heads = [x.new_zeros(batch)]
    for c in range(num_chunks - 1, 0, -1):
        heads.append(local[:, c, 0] + chunk_decay[:, c] * heads[-1])
    next_head = torch.stack(heads[::-1], dim=1).unsqueeze(-1)  # head of chunk c + 1   [B, N, 1]
    y = local + power[in_chunk - before] * next_head
    return y.reshape(batch, num_chunks * chunk)[:, :length]
