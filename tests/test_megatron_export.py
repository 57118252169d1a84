"""The pipeline-parallel weight export (roles.trainer.megatron.export) on the CPU: two gloo
processes hold pipeline stages 0 and 1 of a model (and four hold one layer each, so the
stages between the first and the last relay and drop each other's tensors) (each stage the shards of its TP ranks, as
mapper.hf_to_megatron makes them). pp rank 0 must come out with the whole HF state dict,
bit-identical to the reference, stage 0's tensors first; stage 1 with its own part. The
metadata each stage announces comes from the mapping on meta tensors
(export.model_hf_weights, what MegatronCore.named_hf_weights runs). The megatron trainer's
own run of it (PP2 on one GPU) is in tests/test_megatron_gpu_parallel.py."""

from __future__ import annotations

import pytest
import torch

from roles.trainer.megatron.mapper import hf_to_megatron, megatron_names, stage_to_hf
from roles.trainer.megatron.shape import megatron_spec
from tests.test_megatron_mapper import hf_state, qwen3_config
from tests.test_megatron_parallel import run_gloo_ranks

# (case, tied embeddings, critic, TP size, dtype): tied + PP keeps a copy of the embedding on
# the last stage that must not be exported twice; the critic's value head is on the last stage.
CASES = [("tied_tp2", True, False, 2, torch.float32), ("untied_tp1_bf16", False, False, 1, torch.bfloat16),
         ("critic_tp2", True, True, 2, torch.float32)]


def _reference(tied: bool, critic: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in hf_state(qwen3_config(tied), critic=critic).items()}


def _export_worker(rank: int, group) -> dict:
    from roles.trainer.megatron.export import model_hf_weights

    out = {}
    for case, tied, critic, tp, dtype in CASES:
        config = qwen3_config(tied)
        shape = megatron_spec(config)
        hf = _reference(tied, critic, dtype)
        shards = [hf_to_megatron(hf, shape, tp_rank=t, tp_size=tp, pp_rank=rank, pp_size=2, critic=critic)
                  for t in range(tp)]
        # TP rank 0 of this stage; its TP peers' shards stand in for the all-gather
        out[case] = list(model_hf_weights(shards[0], shape, tp_size=tp,
                                          tp_shards=lambda name, _, shards=shards: [s[name] for s in shards],
                                          pp_group=group, pp_rank=rank, pp_size=2, spec="local", critic=critic,
                                          device="cpu"))
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return run_gloo_ranks(_export_worker, tmp_path_factory.mktemp("export"))


@pytest.mark.parametrize("case,tied,critic,tp,dtype", CASES, ids=[c[0] for c in CASES])
def test_every_stage_reaches_pp_rank_zero_bit_identical(exported, case, tied, critic, tp, dtype):
    hf = _reference(tied, critic, dtype)
    trunk = "backbone." if critic else "model."
    stage1 = {n for n in hf if n.startswith((f"{trunk}layers.2.", f"{trunk}layers.3.", f"{trunk}norm.", "lm_head.",
                                             "value_head."))}
    for rank, want in ((0, set(hf)), (1, stage1)):
        names = [name for name, _ in exported[rank][case]]
        assert len(names) == len(set(names)) and set(names) == want, (rank, set(names) ^ want)
        for name, tensor in exported[rank][case]:
            assert tensor.dtype == dtype and torch.equal(tensor, hf[name]), (rank, name)
    # pipeline order on rank 0: stage 0 (embedding, layers 0-1), then stage 1 (layers 2-3, norm, head)
    names = [name for name, _ in exported[0][case]]
    assert names.index(f"{trunk}embed_tokens.weight") == 0
    assert all(n in stage1 for n in names[len(hf) - len(stage1):])
    assert names[-1] == ("value_head.bias" if critic else f"{trunk}norm.weight" if tied else "lm_head.weight")


def test_stage_names_carry_the_global_layer_offset():
    """Stage 1 of 2 of a 4-layer model holds megatron layers 0-1, exported as HF layers 2-3."""
    config = qwen3_config(False)
    shape = megatron_spec(config)
    hf = hf_state(config)
    stage1 = hf_to_megatron(hf, shape, tp_rank=0, tp_size=1, pp_rank=1, pp_size=2)
    assert {n.split(".")[2] for n in megatron_names(shape, pp_rank=1, pp_size=2) if n.startswith("decoder.layers.")} \
        == {"0", "1"}
    pairs = dict(stage_to_hf(lambda name: [stage1[name]], shape, pp_rank=1, pp_size=2))
    assert {n.split(".")[2] for n in pairs if n.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" not in pairs and torch.equal(pairs["lm_head.weight"], hf["lm_head.weight"])
    for name, tensor in pairs.items():
        assert torch.equal(tensor, hf[name]), name


def _export_pp4_worker(rank: int, group) -> list:
    from roles.trainer.megatron.export import model_hf_weights
    from roles.weight_views import LazyReshape

    shape = megatron_spec(qwen3_config(False))
    stage = hf_to_megatron(_reference(False, False, torch.float32), shape, tp_rank=0, tp_size=1, pp_rank=rank,
                           pp_size=4)
    pairs = model_hf_weights(stage, shape, tp_size=1, tp_shards=lambda name, t: [t], pp_group=group,
                             pp_rank=rank, pp_size=4, spec="local", critic=False, device="cpu", views=True)
    # (name, tensor): a LazyReshape as its HF tensor, its name marked
    return [(name + " (lazy)", t.materialize()) if isinstance(t, LazyReshape) else (name, t) for name, t in pairs]


def test_with_four_stages_rank_zero_gets_all_in_order_and_the_middle_stages_their_own(tmp_path):
    """PP4 of the 4-layer model: stage k holds layer k (stage 0 the embedding too, stage 3 the
    norm and the head). Exported for the weight sync (`views`): rank 0's own q/k/v come as
    windows of its parameters (LazyReshape), every stage's it receives as HF tensors, and a
    later stage broadcasts HF tensors (it checks them against the announced shapes)."""
    hf = _reference(False, False, torch.float32)
    ranks = run_gloo_ranks(_export_pp4_worker, tmp_path, world_size=4)

    def stage_of(name: str) -> int:
        if name.startswith("model.layers."):
            return int(name.split(".")[2])
        return 0 if name == "model.embed_tokens.weight" else 3

    lazy = [name.removesuffix(" (lazy)") for name, _ in ranks[0] if name.endswith(" (lazy)")]
    assert lazy == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert not any(name.endswith(" (lazy)") for pairs in ranks[1:] for name, _ in pairs)
    ranks[0] = [(name.removesuffix(" (lazy)"), t) for name, t in ranks[0]]
    for rank, pairs in enumerate(ranks):
        names = [name for name, _ in pairs]
        want = set(hf) if rank == 0 else {n for n in hf if stage_of(n) == rank}
        assert len(names) == len(set(names)) and set(names) == want, (rank, set(names) ^ want)
        assert all(torch.equal(t, hf[n]) for n, t in pairs), rank
    stages = [stage_of(name) for name, _ in ranks[0]]
    assert stages == sorted(stages)  # pipeline order
