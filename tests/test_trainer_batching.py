"""Trainer pieces without a model: micro-batch planning, batch checks, lr schedule, config."""

import math

import pytest
import torch

from roles.trainer.batching import (
    check_batch,
    collate,
    plan_micro_batches,
    sequences,
    split_mini_batches,
)
from roles.trainer.config import TrainerConfig
from roles.trainer.schedule import LRSchedule


def test_fixed_micro_batches_are_consecutive_groups():
    assert plan_micro_batches([5] * 5, micro_batch_size=2) == [[0, 1], [2, 3], [4]]


def test_dynamic_micro_batches_respect_padded_token_budget_and_cover_every_sample():
    lengths = [7, 3, 9, 2, 4, 8, 1, 6]
    groups = plan_micro_batches(lengths, max_tokens=16)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) * max(lengths[i] for i in g) <= 16
        assert g == sorted(g)  # positions in sample order inside a group
    # first-fit over 9, 8, 7, 6, 4, 3, 2, 1; a bin costs (members x its first, longest, length)
    assert groups == [[2], [0, 5], [4, 7], [1, 3, 6]]


def test_dynamic_micro_batch_gives_an_oversized_sample_its_own_group():
    groups = plan_micro_batches([3, 40, 3], max_tokens=10)
    assert [1] in groups
    assert sorted(i for g in groups for i in g) == [0, 1, 2]


def test_plan_needs_exactly_one_limit():
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1, 2])
    with pytest.raises(ValueError, match="exactly one"):
        plan_micro_batches([1, 2], micro_batch_size=1, max_tokens=4)


def test_with_sessions_the_global_batch_counts_sessions_and_keeps_each_whole():
    sessions = torch.tensor([0, 0, 1, 2, 2, 2, 3, 4, 5, 5])  # an agent session's records are one session
    assert split_mini_batches(10, 3, sessions) == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9]]
    with pytest.raises(ValueError, match="6 samples, not a multiple of global_batch_size=4"):
        split_mini_batches(10, 4, sessions)
    with pytest.raises(ValueError, match="non-decreasing"):
        split_mini_batches(3, 1, torch.tensor([0, 1, 0]))


def test_mini_batches_need_a_multiple_of_global_batch_size():
    assert split_mini_batches(6, 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="global_batch_size=4"):
        split_mini_batches(6, 4)


def _batch():
    prompt_lens, response_lens = torch.tensor([2, 3]), torch.tensor([3, 1])
    input_ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 0]])
    return {"input_ids": input_ids, "prompt_lens": prompt_lens, "response_lens": response_lens,
            "loss_mask": torch.ones(2, 3)}


def test_packed_and_padded_input_ids_give_the_same_sequences():
    padded = _batch()
    packed = dict(padded, input_ids=torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13]))
    assert check_batch(packed, ("loss_mask",)) == check_batch(padded, ("loss_mask",)) == 2
    for a, b in zip(sequences(padded), sequences(packed)):
        assert torch.equal(a, b)


def test_collate_right_pads_and_slices_response_tensors_to_the_micro_batch():
    batch = _batch()
    mb = collate(sequences(batch), batch, [1], ("loss_mask",))
    assert mb.input_ids.tolist() == [[10, 11, 12, 13]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1]]
    assert mb.response["loss_mask"].shape == (1, 1)


def test_check_batch_names_the_bad_field():
    batch = _batch()
    with pytest.raises(ValueError, match="missing \\['advantages'\\]"):
        check_batch(batch, ("advantages",))
    with pytest.raises(ValueError, match="loss_mask has shape"):
        check_batch(dict(batch, loss_mask=torch.ones(2, 2)), ("loss_mask",))
    with pytest.raises(ValueError, match="input_ids"):
        check_batch(dict(batch, input_ids=batch["input_ids"][:, :3]), ())


def test_lr_schedule_warmup_then_cosine_and_linear_decay():
    cos = LRSchedule(lr=1.0, min_lr=0.1, schedule="cosine", warmup_steps=2, decay_steps=4)
    assert [cos.lr_at(s) for s in (0, 1)] == [0.5, 1.0]
    assert cos.lr_at(2) == 1.0
    assert math.isclose(cos.lr_at(4), 0.1 + 0.9 * 0.5)
    assert math.isclose(cos.lr_at(6), 0.1) and math.isclose(cos.lr_at(100), 0.1)
    lin = LRSchedule(lr=1.0, min_lr=0.0, schedule="linear", warmup_steps=0, decay_steps=4)
    assert [lin.lr_at(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    const = LRSchedule(lr=0.3, min_lr=0.0, schedule="constant", warmup_steps=0, decay_steps=None)
    assert const.lr_at(1000) == 0.3


def test_config_rejects_bad_values_with_field_names():
    base = dict(hf_checkpoint="x", seed=1, lr=1e-6, min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0,
                weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4, micro_batch_size=2,
                eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean", use_kl_loss=False,
                kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False)
    TrainerConfig.from_dict(base)
    with pytest.raises(ValueError, match="missing fields \\['lr'\\]"):
        TrainerConfig.from_dict({k: v for k, v in base.items() if k != "lr"})  # no second default
    with pytest.raises(ValueError, match="exactly one of micro_batch_size"):
        TrainerConfig.from_dict(dict(base, max_tokens_per_gpu=100))
    with pytest.raises(ValueError, match="lr_decay_iters"):
        TrainerConfig.from_dict(dict(base, lr_decay_style="cosine"))
    with pytest.raises(ValueError, match="eps_clip=1.5"):
        TrainerConfig.from_dict(dict(base, eps_clip=1.5))
    with pytest.raises(ValueError, match="keep_ref=True"):
        TrainerConfig.from_dict(dict(base, use_kl_loss=True))
    with pytest.raises(ValueError, match="unknown fields \\['lr_typo'\\]"):
        TrainerConfig.from_dict(dict(base, lr_typo=1))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        TrainerConfig.from_dict(dict(base, loss_agg_mode="mean"))
    assert TrainerConfig.from_dict(dict(base, betas=[0.9, 0.95])).betas == (0.9, 0.95)
