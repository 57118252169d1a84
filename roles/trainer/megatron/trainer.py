"""The megatron actor and critic trainer roles: the endpoints of roles.trainer.actor / critic
(same names, arguments and results) over roles.trainer.megatron.core.MegatronCore.

The objectives are both backends': roles.trainer.objectives.policy_objective and
value_objective.

In a rank group with TP or PP > 1 the weights leave through rank 0 (dp 0, cp 0, tp 0, pp 0),
after its TP peers join the all-gather of the shards and the later pipeline stages send
theirs (roles.trainer.megatron.export): the weight endpoints (sync_weights, save_hf,
weights_checksum) run the gather on every rank for which MegatronCore.gathers_weights
holds, and ActorRole's own endpoints send from rank 0.
"""

from __future__ import annotations

from typing import Iterator

import torch

from roles.trainer.actor import ActorRole
from roles.trainer.critic import CriticRole
from roles.trainer.distributed import is_rank_zero
from roles.trainer.megatron.config import MegatronTrainerConfig
from roles.trainer.megatron.core import MegatronCore
from roles.trainer.megatron.logprobs import vocab_parallel_log_probs, vocab_shard
from roles.trainer.megatron.packing import PackedMicroBatch
from roles.trainer.objectives import policy_objective, value_objective
from roles.trainer.role import TrainerRole, checked_config
from roles.weight_checksum import checksum_named_tensors
from runtime import endpoint, wire


wire.register_config(MegatronTrainerConfig)  # it travels to each rank's process as itself


class _MegatronRole(TrainerRole):
    _core: MegatronCore

    def _build(self, config: MegatronTrainerConfig, *, critic: bool, role: str, hf_state: dict | None) -> None:
        self.config = checked_config(config, MegatronTrainerConfig)
        self._join_group()
        torch.manual_seed(self.config.seed)
        self._core = MegatronCore(self.config, critic=critic, memory=self._device_memory(role), hf_state=hf_state)
        self._started(transformer_impl=self.config.transformer_impl)  # the choice, in the run's events

    @endpoint
    def rank_layout(self) -> dict:
        """{"dp_rank", "dp_size", "is_output"}: megatron's data-parallel rank; the output rank of
        a dp rank is its TP rank 0, CP rank 0 on the last pipeline stage."""
        from megatron.core import parallel_state as ps

        is_output = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                     and ps.is_pipeline_last_stage())
        return {"dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
                "is_output": is_output}


class MegatronActorTrainer(_MegatronRole, ActorRole):
    """The policy on megatron-core (roles.trainer.megatron).

    `hf_state` (in-process use: tests, bench) replaces reading the checkpoint's safetensors.
    """

    def __init__(self, config: MegatronTrainerConfig, hf_state: dict | None = None):
        self._build(config, critic=False, role="actor", hf_state=hf_state)
        self._ref_params = self._core.ref_params

    # ---- forward ------------------------------------------------------------------------

    def _processor(self, mb: PackedMicroBatch, *, with_entropy: bool, entropy_grad: bool):
        cfg, core = self.config, self._core

        def process(hidden, targets, output_weight, output_layer):
            full = output_weight if output_weight is not None else output_layer.weight
            weight, start = vocab_shard(full, vocab_size=core.shape.vocab_size, tp_rank=core.tp_rank)
            return vocab_parallel_log_probs(hidden, weight, targets, vocab_start=start, temperature=cfg.temperature,
                                            chunk=cfg.logits_chunk_tokens, with_entropy=with_entropy,
                                            entropy_grad=entropy_grad, group=core.tp_group)

        return process

    def _log_prob_processor(self, mb: PackedMicroBatch):
        return self._processor(mb, with_entropy=False, entropy_grad=False)

    def _log_prob_fn(self):
        return self._log_prob_processor

    def _parameters(self) -> list[torch.Tensor]:
        return list(self._core.module.parameters())

    # ---- training -----------------------------------------------------------------------

    def _objective(self):
        return self  # MegatronCore.train's MegatronObjective: processor and loss below

    def processor(self, mb: PackedMicroBatch):
        cfg = self.config
        return self._processor(mb, with_entropy=cfg.entropy_coef != 0 or cfg.log_entropy,
                               entropy_grad=cfg.entropy_coef != 0)

    def loss(self, out, mb: PackedMicroBatch, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy objective (roles.trainer.objectives) on [n, Rm] rows."""
        lp_flat, ent_flat = out
        entropy = mb.to_rows(ent_flat) if ent_flat.numel() else None
        loss, metrics = policy_objective(self.config, mb.to_rows(lp_flat), entropy, mb, counts)
        return loss, {k: torch.as_tensor(v, dtype=torch.float32) for k, v in metrics.items()}

    # ---- weights (ActorRole's endpoints over named_weights) ------------------------------

    def named_weights(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """ActorRole.named_weights: megatron's tensors mapped back to HF names; `views`: q/k/v at
        TP1 as LazyReshapes."""
        self._core.require_onloaded("params")
        yield from self._core.named_hf_weights(views=views)

    def _weights_out(self, endpoint_fn, *args, **kwargs):
        """Run ActorRole's weight endpoint: rank 0 reads named_weights; its TP and pipeline
        peers feed the all-gather and the stage broadcasts by reading them too (and drop
        them); other ranks hold replicas.

        Known limit: if rank 0's send fails mid-way (an engine error), or a later stage finds
        its weights differ from what it announced (export.py: a mapper bug), the other ranks
        wait in the next collective until the process group's timeout; the group then dies
        as one and the driver stops the run (resume with --load)."""
        if self._core.gathers_weights and not is_rank_zero():
            for _ in self.named_weights():
                pass
        return endpoint_fn(self, *args, **kwargs)

    @endpoint
    def weights_checksum(self) -> dict[str, str]:
        """HF name -> digest (ActorRole.weights_checksum) from each rank that gathers the
        weights: on pipeline stage 0 the whole model (rank 0 and its TP peers, all equal), on
        a later stage its own part; other ranks {}. The last stage of a pipelined model with
        tied embeddings adds its copy of the embedding under the embedding's name
        (MegatronCore.tied_embedding_copy). The group merges them (a union that refuses two
        digests for one name: a copy that drifted from stage 0's fails the check)."""
        if not self._core.gathers_weights:
            return {}
        return {**ActorRole.weights_checksum(self), **checksum_named_tensors(self._core.tied_embedding_copy())}

    @endpoint
    def sync_weights(self, *args, **kwargs) -> dict:
        """ActorRole.sync_weights from rank 0, the TP shards and pipeline stages gathered."""
        return self._weights_out(ActorRole.sync_weights, *args, **kwargs)

    @endpoint
    def save_hf(self, path: str) -> dict:
        """ActorRole.save_hf from rank 0, the TP shards and pipeline stages gathered."""
        return self._weights_out(ActorRole.save_hf, path)


class MegatronCriticTrainer(_MegatronRole, CriticRole):
    """The value model on megatron-core: the policy's trunk and an untied Linear(hidden, 1)."""

    def __init__(self, config: MegatronTrainerConfig, hf_state: dict | None = None):
        self._build(config, critic=True, role="critic", hf_state=hf_state)

    def processor(self, mb: PackedMicroBatch):
        def process(hidden, targets, output_weight, output_layer):
            return (output_layer(hidden)[0].squeeze(-1).float(),)  # [nr]; the head is replicated over TP

        return process

    def _value_fn(self):
        return self.processor

    def _objective(self):
        return self  # MegatronCore.train's MegatronObjective: processor above, loss below

    def loss(self, out, mb: PackedMicroBatch, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The value objective (roles.trainer.objectives) on [n, Rm] rows."""
        return value_objective(self.config, mb.to_rows(out[0]), mb, counts)

