"""Decoupled PPO (--train-async) as the code computes it — the driver's TIS weights
(ppo.loop.mismatch_correction, actor_batch), then the actor's policy objective over micro-batches
(roles.trainer.objectives) — held to a float64 reference written from AReaL's objective
(Fu et al. 2025, "AReaL: a large-scale asynchronous RL system", eq. 5), one token at a time:

    loss_t = -w_t * min(u_t * A_t, clip(u_t, 1 - eps, 1 + eps_high) * A_t)
    u_t = pi_theta(a_t) / pi_prox(a_t)             the ratio against the proximal policy
    w_t = min(pi_prox(a_t) / pi_behav(a_t), C)      the behaviour weight, truncated (TIS)

pi_behav is the engine that sampled the tokens one version back (rollout_log_probs), pi_prox the
trainer before this update (old_log_probs). AReaL rejects tokens whose weight passes the cap;
truncating at C is TIS's choice, which Tandem shares (docs/algorithms.md)."""

from types import SimpleNamespace

import pytest
import torch

from ppo.config import override
from ppo.loop import actor_batch, mismatch_correction
from ppo.setup.user_functions import load_user_functions
from ppo.config.recipes import tiny_ppo
from roles.trainer.config import TrainerConfig
from roles.trainer.objectives import policy_objective
from roles.trainer.sharding import aggregation_counts
from tests.test_trainer_objectives import BASE

EPS, EPS_HIGH, C = 0.2, 0.28, 2.0
ASYNC = dict(train_async=True, colocate=False, actor_num_gpus_per_node=1, rollout_num_gpus=1,
             eps_clip=EPS, eps_clip_high=EPS_HIGH, tis_clip=C)


def actor_config(mode: str) -> TrainerConfig:
    return TrainerConfig(**dict(BASE, eps_clip=EPS), eps_clip_high=EPS_HIGH, value_clip=0.2, loss_agg_mode=mode)


def reference_loss(logp, prox, behav, adv, valid, mode) -> torch.Tensor:
    """AReaL's decoupled loss with TIS weights, token by token in float64, then the mode's
    mean (as tests/test_trainer_objectives.reference_value_loss)."""
    rows = []
    for i in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            if not valid[i, t]:
                continue
            u = torch.exp(logp[i, t].double() - float(prox[i, t]))
            w = min(float(torch.exp(prox[i, t].double() - float(behav[i, t]))), C)
            a = float(adv[i, t])
            row.append(-w * torch.minimum(u * a, torch.clamp(u, 1 - EPS, 1 + EPS_HIGH) * a))
        rows.append(row)
    zero = logp.new_zeros((), dtype=torch.float64)
    if mode == "token-mean":
        return sum((x for row in rows for x in row), zero) / sum(len(r) for r in rows)
    means = [sum(row, zero) / len(row) for row in rows if row]
    return sum(means, zero) / (len(rows) if mode == "sum-of-sample-mean" else len(means))


@pytest.mark.parametrize("mode", ["sum-of-sample-mean", "token-mean", "seq-mean-token-mean"])
def test_decoupled_ppo_through_driver_and_trainer_equals_a_float64_reference(mode):
    g = torch.Generator().manual_seed(1)
    n, width = 6, 7
    behav = -torch.rand(n, width, generator=g) * 2  # the engine, one version back
    prox = behav + 0.4 * torch.randn(n, width, generator=g)  # the trainer before the update
    prox[0, 0] = behav[0, 0] + 2.0  # a weight past C: truncated
    logp = (prox + 0.3 * torch.randn(n, width, generator=g)).requires_grad_()
    adv = torch.randn(n, width, generator=g)
    mask = (torch.rand(n, width, generator=g) > 0.25).float()
    mask[0, 0], mask[4] = 1, 0  # an empty row
    batch = {"loss_mask": mask, "old_log_probs": prox, "rollout_log_probs": behav, "advantages": adv,
             "input_ids": torch.zeros(n, 9, dtype=torch.long), "prompt_lens": torch.full((n,), 2),
             "response_lens": torch.full((n,), width)}

    cfg = override(tiny_ppo(), **ASYNC)
    tis = load_user_functions(cfg).tis_function
    mismatch_correction(cfg, batch, tis)
    sent = actor_batch(cfg, batch)  # what the actor trains on
    assert torch.equal(sent["old_log_probs"], prox)
    trainer = actor_config(mode)
    valid = mask.bool()
    counts = aggregation_counts(valid, mode)
    loss = torch.zeros((), dtype=torch.float64)
    for rows in ([0, 1, 2], [3, 4, 5]):  # two micro-batches of one mini-batch
        mb = SimpleNamespace(response={k: sent[k][rows] for k in ("old_log_probs", "advantages", "tis_weights")},
                             valid=valid[rows])
        part, _ = policy_objective(trainer, logp[rows], None, mb, counts)
        loss = loss + part
    (grad,) = torch.autograd.grad(loss, logp)

    expect = reference_loss(logp, prox, behav, adv, valid, mode)
    (expect_grad,) = torch.autograd.grad(expect, logp)
    torch.testing.assert_close(loss, expect, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expect_grad.float(), rtol=1e-5, atol=1e-7)
    # both corrections are exercised: a truncated weight and clipped ratios
    assert float(sent["tis_weights"][0, 0]) == C
    u = (logp - prox).exp()[valid]
    assert ((u < 1 - EPS) | (u > 1 + EPS_HIGH)).any()


def test_without_the_behaviour_weights_the_loss_differs_from_the_reference():
    """The reference is not satisfied by plain PPO against the proximal policy (the test can fail)."""
    g = torch.Generator().manual_seed(2)
    behav = -torch.rand(3, 4, generator=g)
    prox = behav + 0.5 * torch.randn(3, 4, generator=g)
    logp = prox.clone()
    adv, valid = torch.randn(3, 4, generator=g), torch.ones(3, 4, dtype=torch.bool)
    trainer = actor_config("token-mean")
    mb = SimpleNamespace(response={"old_log_probs": prox, "advantages": adv}, valid=valid)
    plain, _ = policy_objective(trainer, logp, None, mb, aggregation_counts(valid, "token-mean"))
    expect = reference_loss(logp, prox, behav, adv, valid, "token-mean")
    assert abs(plain.item() - expect.item()) > 1e-3
