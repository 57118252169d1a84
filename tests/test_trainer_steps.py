"""roles.trainer.steps: the one train-step skeleton of both backends: the one-row check on a
rank's plan, non-finite steps skipped, metrics averaged over the steps taken and skipped."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from roles.trainer.config import TrainerConfig
from roles.trainer.megatron import MegatronTrainerConfig
from roles.trainer.steps import LOSS, train_pass

BASE = dict(hf_checkpoint="x", seed=0, lr=1.0, min_lr=0.0, lr_decay_style="linear", lr_warmup_iters=0,
            lr_decay_iters=4, weight_decay=0.0, betas=(0.9, 0.999), clip_grad=1.0, global_batch_size=2,
            micro_batch_size=1, eps_clip=0.2, value_clip=0.2, loss_agg_mode="token-mean", use_kl_loss=False,
            kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False)
KEYS = ("loss_mask", "old_values", "returns")


def batch(n: int = 4) -> dict:
    return {"input_ids": torch.ones(n, 4, dtype=torch.long), "prompt_lens": torch.full((n,), 2),
            "response_lens": torch.full((n,), 2), "loss_mask": torch.ones(n, 2), "old_values": torch.zeros(n, 2),
            "returns": torch.ones(n, 2)}


def unreachable(*args, **kwargs):
    raise AssertionError("a micro-batch ran although the plan was refused")


def torch_core():
    from roles.trainer.torch.core import TrainCore

    core = object.__new__(TrainCore)  # only what train reads before the first micro-batch
    config = TrainerConfig(**BASE)
    core.config, core.schedule, core.step, core.offloaded = config, config.lr_schedule_fn, 0, set()
    core.model = torch.nn.Linear(1, 1)
    return core, unreachable


def megatron_core():
    from roles.trainer.megatron.core import MegatronCore

    core = object.__new__(MegatronCore)  # only what train reads before the first micro-batch
    config = MegatronTrainerConfig(**BASE)
    core.config, core.schedule, core.step = config, config.lr_schedule_fn, 0
    core.offloader = SimpleNamespace(offloaded=set())
    core.ddp = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None)
    core.optimizer = SimpleNamespace(zero_grad=lambda: None)
    core.module = torch.nn.Linear(1, 1)
    core._run = unreachable
    return core, SimpleNamespace(processor=unreachable, loss=unreachable)


@pytest.mark.parametrize("make_core", [torch_core, megatron_core], ids=["torch", "megatron"])
@pytest.mark.parametrize("shares", [[0, 4], [2, 1]], ids=["a-share-of-no-rows", "rows-missing"])
def test_both_backends_refuse_a_plan_that_is_not_one_row_or_more_per_step_covering_the_share(make_core, shares):
    core, objective = make_core()
    plan = [{"num_samples": k, "global_batch_size": 8, "global_token_count": 16} for k in shares]
    with pytest.raises(ValueError, match=r"must split the 4 rows of this share, at least one row each"):
        core.train(batch(), KEYS, objective, plan)


class FakeBackend:
    """A StepBackend whose step i has loss `losses[i]` and grad norm `norms[i]`."""

    def __init__(self, losses: list[float], norms: list[float]):
        self.config = TrainerConfig(**BASE)
        self.schedule, self.step = self.config.lr_schedule_fn, 0
        self.losses, self.norms, self.lrs = iter(losses), iter(norms), []

    def accumulate(self, seqs, rows, counts) -> dict[str, float]:
        assert len(rows) == 2 and counts == {"global_batch_size": 2, "global_token_count": 4}
        return {LOSS: next(self.losses), "value_loss": float(rows[0])}

    def apply_step(self, loss: float, lr: float) -> tuple[float, bool]:
        norm = next(self.norms)
        stepped = math.isfinite(loss) and math.isfinite(norm)
        if stepped:
            self.lrs.append(lr)
        return norm, stepped


def test_a_nonfinite_step_is_skipped_uncounted_and_its_metrics_still_averaged():
    core = FakeBackend(losses=[1.0, math.nan, 2.0], norms=[0.5, 7.0, math.inf])
    metrics = train_pass(core, batch(6), KEYS, None, core.accumulate)
    assert core.step == 1 and core.lrs == [1.0]  # linear decay: step 0 at lr, the skips left it there
    assert metrics["skipped_nonfinite"] == 2 and metrics["lr"] == 1.0
    assert metrics["value_loss"] == (0 + 2 + 4) / 3  # every step's metric, skipped or not
    assert math.isinf(metrics["grad_norm"])


def test_the_lr_reported_is_the_last_step_taken():
    core = FakeBackend(losses=[1.0, 1.0, 1.0], norms=[0.5, 0.5, 0.5])
    metrics = train_pass(core, batch(6), KEYS, None, core.accumulate)
    assert core.step == 3 and core.lrs == [1.0, 0.75, 0.5] and metrics["lr"] == 0.5
