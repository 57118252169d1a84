"""Splitting a batch over data-parallel ranks, and putting the ranks' results back in order.

Pure functions on the batch schema of roles.trainer.batching (no processes), used by
roles.trainer.group. Rows stay whole; a share keeps its rows in batch order, so that the
rank's results map back by position.

Balance: greedy longest-first onto the least-loaded rank (LPT), cost = prompt + response
tokens of a row, the work of a forward and backward. Any set of at least `num_shards`
rows gives every rank at least one row: the first `num_shards` rows each land on an
empty rank.
"""

from __future__ import annotations

import torch

from roles.trainer.batching import split_mini_batches, valid_mask


def balance(costs: list[int], num_shards: int) -> list[list[int]]:
    """Positions 0..len(costs)-1 in `num_shards` groups of near-equal total cost, each sorted."""
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}: must be >= 1")
    loads = [0] * num_shards
    groups: list[list[int]] = [[] for _ in range(num_shards)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        s = min(range(num_shards), key=lambda s: (loads[s], s))
        groups[s].append(i)
        loads[s] += costs[i]
    return [sorted(g) for g in groups]


def row_costs(batch: dict) -> list[int]:
    return (batch["prompt_lens"] + batch["response_lens"]).tolist()


def aggregation_counts(valid: torch.Tensor, mode: str) -> dict:
    """The whole mini-batch's counts for algorithms.aggregate, given its valid mask [n, R]."""
    if mode == "sum-of-sample-mean":
        rows = valid.shape[0]
    else:  # seq-mean modes count the rows with at least one valid token
        rows = int(valid.any(-1).sum())
    return {"global_batch_size": rows, "global_token_count": int(valid.sum())}


def plan_forward(batch: dict, dp_size: int) -> list[list[int]]:
    """Row indices of each dp rank's share of a forward-only batch (at least one row each)."""
    costs = row_costs(batch)
    if len(costs) < dp_size:
        raise ValueError(f"a batch of {len(costs)} samples cannot give each of {dp_size} data-parallel ranks a row")
    return balance(costs, dp_size)


def plan_train(batch: dict, dp_size: int, global_batch_size: int, loss_agg_mode: str
               ) -> tuple[list[list[int]], list[list[dict]]]:
    """Each dp rank's rows and mini-batch list for `train` (the rank contract in group.py).

    Mini-batches are the consecutive global_batch_size rows (sessions, where the batch has
    "sessions": roles.trainer.batching.split_mini_batches) that one process would step on;
    each is balanced over the ranks on its own, and a rank's share is its part of mini-batch
    0, then of mini-batch 1, ... Every rank gets >= 1 row of each mini-batch when
    global_batch_size >= dp_size (validation ensures it).
    """
    costs = row_costs(batch)
    n = len(costs)
    rows: list[list[int]] = [[] for _ in range(dp_size)]
    minis: list[list[dict]] = [[] for _ in range(dp_size)]
    for mini in split_mini_batches(n, global_batch_size, batch.get("sessions")):
        idx = torch.tensor(mini)
        counts = aggregation_counts(valid_mask(batch["loss_mask"][idx], batch["response_lens"][idx]), loss_agg_mode)
        for rank, part in enumerate(balance([costs[i] for i in mini], dp_size)):
            if not part:
                raise ValueError(f"mini-batch of {len(mini)} samples cannot give each of {dp_size} data-parallel "
                                 "ranks a row; make global_batch_size >= the data-parallel size")
            rows[rank] += [mini[p] for p in part]
            minis[rank].append({"num_samples": len(part), **counts})
    return rows, minis


def take_rows(batch: dict, rows: list[int]) -> dict:
    """The sub-batch of `rows` (in that order), widths trimmed to its longest row.

    Tensors with N rows are indexed; packed input_ids [S] are cut per sample; anything else
    (a scalar, a string) is passed as is.
    """
    n = batch["prompt_lens"].numel()
    idx = torch.tensor(rows, dtype=torch.long)
    totals = batch["prompt_lens"] + batch["response_lens"]
    width, resp = int(totals[idx].max()), int(batch["response_lens"][idx].max())
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
        elif key == "input_ids" and value.dim() == 1:  # packed: samples back to back
            starts = torch.cumsum(totals, 0) - totals
            out[key] = torch.cat([value[int(starts[i]):int(starts[i] + totals[i])] for i in rows])
        elif value.shape[0] != n:
            raise ValueError(f"batch[{key!r}] has {value.shape[0]} rows, expected N={n}")
        elif value.dim() == 1:
            out[key] = value[idx]
        else:
            keep = width if key == "input_ids" else resp  # every other 2-D key is response-aligned [N, R]
            out[key] = value[idx, :keep].contiguous()
    return out


def put_rows(parts: list[tuple[list[int], dict]], num_rows: int) -> dict:
    """Reassemble per-share results {key: [n_share, ...]} into {key: [num_rows, ...]} in batch
    order; shares narrower than the widest are zero-padded (response-aligned outputs are zero
    at padding)."""
    out: dict = {}
    for key in parts[0][1]:
        values = [p[key] for _, p in parts]
        width = max(v.shape[1] for v in values) if values[0].dim() > 1 else None
        shape = (num_rows,) + ((width,) + tuple(values[0].shape[2:]) if width is not None else ())
        full = torch.zeros(shape, dtype=values[0].dtype)
        for (rows, _), v in zip(parts, values):
            if width is None:
                full[torch.tensor(rows)] = v
            else:
                full[torch.tensor(rows), : v.shape[1]] = v
        out[key] = full
    return out
