"""The actor trainer role (torch backend): policy log-probs, PPO policy updates, weight sync."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator, Mapping

import torch

from ppo.algorithms import aggregate, kl_estimate, policy_loss
from roles.trainer.batching import ACTOR_TRAIN_KEYS, MicroBatch
from roles.trainer.checkpoint import save_hf_checkpoint
from roles.trainer.config import TrainerConfig
from roles.trainer.core import TrainCore, token_share
from roles.trainer.distributed import is_rank_zero
from roles.trainer.model import load_policy, policy_log_probs
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import bucket_nbytes, is_direct, send_to_engines
from roles.trainer.role import TrainerRole
from runtime import endpoint


class ActorTrainer(TrainerRole):
    """Policy model of PPO. Batches follow roles.trainer.batching; memory roles.trainer.core.

    Starts offloaded: call `onload(["params"])` (and "optimizer" before training) first.
    """

    def __init__(self, config: TrainerConfig | Mapping[str, Any]):
        self._join_group()
        self.config = config if isinstance(config, TrainerConfig) else TrainerConfig.from_dict(config)
        torch.manual_seed(self.config.seed)
        model = load_policy(self.config.hf_checkpoint, gradient_checkpointing=self.config.gradient_checkpointing)
        # The reference policy is the initial one; a CPU copy, swapped in for ref log-probs.
        self._ref_params = (
            [p.detach().clone() for p in model.parameters()] if self.config.keep_ref else None
        )
        self._core = TrainCore(self.config, model, self._device_memory("actor"))
        self._started()

    @property
    def model(self) -> torch.nn.Module:
        return self._core.model

    # ---- forward ------------------------------------------------------------------------

    def _log_probs(self, mb: MicroBatch) -> torch.Tensor:
        log_probs, _ = policy_log_probs(
            self.model, mb, temperature=self.config.temperature, dtype=self.config.torch_dtype, with_entropy=False
        )
        return log_probs

    @endpoint
    def compute_log_probs(self, batch: dict) -> dict:
        """{"log_probs": float32 [N, R]} under the current policy, at the rollout temperature."""
        return {"log_probs": self._core.forward_only(batch, self._log_probs)}

    @endpoint
    def compute_ref_log_probs(self, batch: dict) -> dict:
        """{"log_probs": float32 [N, R]} under the reference (initial) policy."""
        if self._ref_params is None:
            raise RuntimeError("compute_ref_log_probs needs the reference copy; build the actor with keep_ref=True")
        self._core.require_onloaded("params")
        with self._swapped_in(self._ref_params):
            return {"log_probs": self._core.forward_only(batch, self._log_probs)}

    @contextlib.contextmanager
    def _swapped_in(self, weights: list[torch.Tensor]) -> Iterator[None]:
        params = list(self.model.parameters())
        backup = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for param, w in zip(params, weights):
                param.copy_(w)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, b in zip(params, backup):
                    param.copy_(b)

    # ---- training -----------------------------------------------------------------------

    @endpoint
    def train(self, batch: dict, mini_batches: list[dict] | None = None) -> dict:
        """One PPO pass over the batch; metrics (miles names) averaged over optimizer steps:
        pg_loss, pg_clipfrac, ppo_kl, entropy_loss (when entropy_coef != 0 or log_entropy),
        kl_loss (when use_kl_loss), grad_norm, lr (of the last step), skipped_nonfinite.
        `mini_batches`: a rank's share of each mini-batch (roles.trainer.group)."""
        required = ACTOR_TRAIN_KEYS + (("ref_log_probs",) if self.config.use_kl_loss else ()) + optional_train_keys(batch)
        return self._train(batch, required, self._micro_loss, mini_batches)

    def _micro_loss(self, mb: MicroBatch, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        log_probs, entropy = policy_log_probs(
            self.model, mb, temperature=cfg.temperature, dtype=cfg.torch_dtype,
            with_entropy=cfg.entropy_coef != 0 or cfg.log_entropy, entropy_requires_grad=cfg.entropy_coef != 0,
        )
        return policy_objective(cfg, log_probs, entropy, mb, counts)

    # ---- memory -------------------------------------------------------------------------

    # ---- weights ------------------------------------------------------------------------

    def named_weights(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in the compute dtype) for every parameter, as the checkpoint names them.

        Tied weights appear once, under the name the HF checkpoint stores. `views` (the weight
        sync only): a backend may give a tensor that no view of its parameters shapes as HF does
        as a roles.weight_views.LazyReshape instead of a copy (megatron's q/k/v at TP1); this
        backend's parameters are HF tensors already.
        """
        for name, param in self.model.named_parameters():
            yield name, param.detach().to(self.config.torch_dtype)

    @endpoint
    def weights_checksum(self) -> dict[str, str]:
        """HF name -> exact digest of the weights an engine would receive."""
        return checksum_named_tensors(self.named_weights())

    @endpoint
    def sync_weights(self, engines: list, buffer_bytes: int, version: int, timeout_s: float = 600.0,
                     engine_gpus: list[list[int]] | None = None) -> dict:
        """Stream the weights to every engine bucket by bucket, then set their weight version.

        Each bucket goes to all engines at once (`roles.weight_sync.send_to_engines`), double
        buffered: the next bucket is packed while the engines load this one, and a buffer is
        packed again only after every engine acked its last bucket; an engine's error or a
        timeout (`timeout_s` per ack) ends the sync and is raised. On a GPU, engines on the
        same physical GPU (`engine_gpus`, physical ids) get CUDA IPC handles. In a rank
        group rank 0 sends (one copy of the weights is enough); the others return zeros.
        """
        start = time.monotonic()
        if not is_rank_zero():
            return {"bytes": 0, "buckets": 0, "seconds": 0.0}

        def acked(bucket: dict, t0: float) -> None:
            self.publish_span("weight_bucket", t0, bytes=bucket_nbytes(bucket),
                              tensors=len(bucket["names"]), engines=len(engines), direct=is_direct(bucket))

        # The bucket buffers sit where the weights are: on the device only when onloaded.
        resident = "params" not in self._core.offloaded
        totals = send_to_engines(self.named_weights(views=True), engines, buffer_bytes, engine_gpus=engine_gpus,
                                 timeout_s=timeout_s, memory=self._core.memory if resident else None, on_bucket=acked)
        for future in [engine.set_weight_version.call(version) for engine in engines]:
            future.result(timeout_s)
        return {"bytes": totals["num_bytes"], "buckets": totals["num_buckets"], "seconds": time.monotonic() - start}

    # ---- checkpoints --------------------------------------------------------------------

    @endpoint
    def save_hf(self, path: str) -> dict:
        """An HF checkpoint of the policy (what the engines run: HF names, compute dtype) with
        the config and tokenizer of the checkpoint it started from, written atomically. In a
        rank group rank 0 writes."""
        start = time.monotonic()
        if not is_rank_zero():
            return {"path": path, "seconds": 0.0}
        # Each tensor to the host as it comes: gathered TP shards and other pipeline stages'
        # weights are fresh device tensors, and the file is written from host memory anyway.
        weights = {name: tensor.to("cpu") for name, tensor in self.named_weights()}
        save_hf_checkpoint(path, weights=weights, source=self.config.hf_checkpoint)
        return {"path": path, "seconds": time.monotonic() - start}


def optional_train_keys(batch: dict) -> tuple[str, ...]:
    """Response-aligned inputs the policy objective reads when the driver sends them:
    tis_weights [N, R], per-token importance weights (--use-tis)."""
    return tuple(k for k in ("tis_weights",) if k in batch)


def policy_objective(cfg: TrainerConfig, log_probs: torch.Tensor, entropy: torch.Tensor | None, mb, counts: dict
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO policy objective of one micro-batch, both backends: clipped policy loss, minus
    entropy_coef * entropy, plus kl_loss_coef * KL to the reference, each aggregated by
    loss_agg_mode with the whole mini-batch's `counts`. The ratio is per token or, for GSPO,
    per sequence (cfg.ratio_level); tis_weights, when sent, weight each token's policy loss.

    log_probs, entropy: [n, Rm] of `mb` (roles.trainer.batching.MicroBatch or
    roles.trainer.megatron.packing.PackedMicroBatch: `.response`, `.valid`); metrics scaled
    so that their sum over a mini-batch's micro-batches is the mini-batch's value.
    """
    r = {k: v.to(log_probs.device) for k, v in mb.response.items()}
    valid = mb.valid.to(log_probs.device)
    pg_loss, pg_metrics = policy_loss(
        log_probs, r["old_log_probs"], r["advantages"], valid,
        eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
        agg=cfg.loss_agg_mode, ratio_level=cfg.ratio_level, is_weights=r.get("tis_weights"), **counts,
    )
    share = token_share(mb, counts)
    metrics = {k: pg_metrics[k] * share for k in ("pg_clipfrac", "ppo_kl", "ois") if k in pg_metrics}
    metrics["pg_loss"] = pg_loss.detach()
    loss = pg_loss
    if entropy is not None:
        entropy_loss = aggregate(entropy, valid, cfg.loss_agg_mode, **counts)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
    if cfg.use_kl_loss:
        kl = kl_estimate(log_probs, r["ref_log_probs"], cfg.kl_loss_type)
        kl_loss = aggregate(kl, valid, cfg.loss_agg_mode, **counts)
        if cfg.kl_loss_coef != 0:
            loss = loss + cfg.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    return loss, metrics
