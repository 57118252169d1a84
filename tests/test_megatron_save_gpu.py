"""megatron actor checkpoints on a GPU (`bash .ci/gpu -k megatron_save`): needs CUDA and megatron-core.

An actor trained one step is saved and loaded into a fresh actor (no Adam state yet): the
fresh one gives the same log-probs, and its next optimizer step is the original's next step
(Adam moments and step counters restored), where the same checkpoint without its Adam
state steps differently.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_megatron_gpu import make_batch, trainer_config

pytestmark = pytest.mark.gpu

megatron = pytest.importorskip("megatron.core") if torch.cuda.is_available() else None


def train_batch(actor, vocab: int, seed: int) -> dict:
    batch = make_batch(vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    return {**batch, "old_log_probs": actor.compute_log_probs(batch)["log_probs"],
            "advantages": torch.randn(4, 6, generator=g)}


def make_actor(ckpt):
    from roles.trainer.megatron import MegatronActorTrainer, MegatronTrainerConfig

    actor = MegatronActorTrainer(MegatronTrainerConfig.from_dict(trainer_config(ckpt, keep_ref=False)))
    actor.onload(["params", "grads", "optimizer"])
    return actor


def test_saved_actor_loads_into_a_fresh_one_with_the_same_log_probs_and_next_step(ckpt, tmp_path):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ckpt).vocab_size
    original = make_actor(ckpt)
    original.train(train_batch(original, vocab, seed=1))  # Adam state and step counter exist now
    saved = original.save(str(tmp_path / "ck"))
    assert saved["step"] == 1

    loaded = make_actor(ckpt)
    assert loaded.load(str(tmp_path / "ck"))["step"] == 1
    probe = make_batch(vocab, seed=5)
    assert torch.equal(loaded.compute_log_probs(probe)["log_probs"], original.compute_log_probs(probe)["log_probs"])
    assert loaded.weights_checksum() == original.weights_checksum()

    # The next step, same batch on both: the float32 main params it gives depend on the restored
    # Adam moments and step counters. Tolerance: varlen attention's backward may sum in another
    # order (bf16 grads one ulp apart move an Adam update by ~1e-7); a wrong Adam state moves
    # it by ~lr = 1e-4.
    batch = train_batch(original, vocab, seed=2)
    m_orig, m_loaded = original.train(batch), loaded.train(batch)
    assert m_loaded["skipped_nonfinite"] == 0
    assert m_loaded["pg_loss"] == pytest.approx(m_orig["pg_loss"], rel=1e-4, abs=1e-6)
    assert m_loaded["grad_norm"] == pytest.approx(m_orig["grad_norm"], rel=1e-3)
    expected = main_params(original)
    assert max_diff(main_params(loaded), expected) < 2e-6

    # Control: the same checkpoint with its Adam state dropped steps visibly differently.
    control = make_actor(ckpt)
    control.load(str(tmp_path / "ck"))
    for opt in control._core._optimizers():
        opt.optimizer.state.clear()
    control.train(batch)
    assert max_diff(main_params(control), expected) > 2e-5


def main_params(actor) -> list[torch.Tensor]:
    return [t.detach().clone() for t in actor._core._main_params()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert [t.shape for t in a] == [t.shape for t in b]
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
