"""One train pass over a rollout batch, both backends: the optimizer-step skeleton.

A pass is consecutive mini-batches, one optimizer step each. For each, the backend
accumulates the gradients of the mini-batch's micro-batches and returns the loss and metric
sums over every rank (`Accumulate`); the skeleton then asks it to step at the schedule's lr
(`StepBackend.apply_step`), which it skips when the loss or grad norm is not finite, and
averages the metrics over the steps. What differs between the backends (how micro-batches
are cut and run, how sums cross ranks, which optimizer steps) stays in their cores.

Mini-batches come from the whole batch (global_batch_size rows each) or, for a rank of a
group, from its plan (the rank contract in roles.trainer.group): consecutive shares of at
least one row each, with the whole mini-batch's aggregation counts.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Protocol

import torch

from roles.trainer.batching import check_batch, sequences, split_mini_batches, valid_mask
from roles.trainer.config import TrainerConfig
from roles.trainer.schedule import LRSchedule
from roles.trainer.sharding import aggregation_counts

LOSS = "__loss"  # the key of the loss among a micro-batch's metrics (its sums cross ranks with them)

# (sequences of the batch, rows of one mini-batch, its aggregation counts) -> sums over its
# micro-batches and every rank of the metrics and, under LOSS, the loss
Accumulate = Callable[[list[torch.Tensor], list[int], dict], dict[str, float]]


class StepBackend(Protocol):
    config: TrainerConfig
    schedule: LRSchedule
    step: int  # optimizer steps taken; skipped steps do not count, as in Megatron

    def apply_step(self, loss: float, lr: float) -> tuple[float, bool]:
        """Clip and step at `lr` unless `loss` or the grad norm is not finite, then clear the
        gradients; (grad norm, whether it stepped)."""


def train_pass(core: StepBackend, batch: dict, required: tuple[str, ...], mini_batches: list[dict] | None,
               accumulate: Accumulate) -> dict:
    """Metrics averaged over the pass's optimizer steps, plus grad_norm, lr (of the last step
    taken) and skipped_nonfinite. A skipped step changes no weight, optimizer state or lr; its
    own (non-finite) metrics still enter the means, so the log shows them."""
    n = check_batch(batch, required)
    seqs = sequences(batch)
    per_step: list[dict[str, float]] = []
    skipped = 0
    lr = core.schedule.lr_at(core.step)
    for rows, counts in plan_steps(batch, n, mini_batches, core.config):
        sums = accumulate(seqs, rows, counts)
        step_lr = core.schedule.lr_at(core.step)
        grad_norm, stepped = core.apply_step(sums.pop(LOSS), step_lr)
        if stepped:
            core.step += 1
            lr = step_lr
        else:
            skipped += 1
        per_step.append({**sums, "grad_norm": grad_norm})
    metrics = {key: sum(s[key] for s in per_step) / len(per_step) for key in per_step[0]}
    metrics.update(lr=lr, skipped_nonfinite=skipped)
    return metrics


def plan_steps(batch: dict, n: int, mini_batches: list[dict] | None, config: TrainerConfig
               ) -> Iterator[tuple[list[int], dict]]:
    """(rows, aggregation counts of the whole mini-batch) for each optimizer step."""
    if mini_batches is None:
        for mini in split_mini_batches(n, config.global_batch_size, batch.get("sessions")):
            idx = torch.tensor(mini)
            valid = valid_mask(batch["loss_mask"][idx], batch["response_lens"][idx])
            yield mini, aggregation_counts(valid, config.loss_agg_mode)
        return
    # A share of no rows runs no micro-batch, so its rank would have no gradients to join its
    # peers' all-reduce with; the group's plan (sharding.plan_train) never makes one.
    if sum(m["num_samples"] for m in mini_batches) != n or min(m["num_samples"] for m in mini_batches) < 1:
        raise ValueError(f"mini_batches {[m['num_samples'] for m in mini_batches]} must split the {n} rows "
                         "of this share, at least one row each")
    start = 0
    for m in mini_batches:
        yield (list(range(start, start + m["num_samples"])),
               {"global_batch_size": m["global_batch_size"], "global_token_count": m["global_token_count"]})
        start += m["num_samples"]


def sum_metrics(stores: Iterable[Mapping[str, torch.Tensor | float]]) -> dict[str, float]:
    """Each metric summed over the micro-batches' metric stores."""
    sums: dict[str, float] = {}
    for store in stores:
        for key, value in store.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums
