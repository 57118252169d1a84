"""The actor trainer role's endpoints, both backends: policy log-probs, PPO policy updates,
weight sync and HF export, over the hooks a backend's role defines (roles.trainer.torch,
roles.trainer.megatron)."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

from roles.trainer.batching import ACTOR_TRAIN_KEYS
from roles.trainer.checkpoint import save_hf_checkpoint
from roles.trainer.distributed import is_rank_zero
from roles.trainer.objectives import optional_train_keys
from roles.trainer.role import TrainerRole
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import bucket_nbytes, is_direct, send_to_engines
from runtime import endpoint


class ActorRole(TrainerRole):
    """Policy model of PPO. Batches follow roles.trainer.batching.

    A backend sets `_ref_params` (the initial weights on the CPU, or None without keep_ref)
    and defines `_parameters`, `_log_prob_fn`, `_objective` and `named_weights`.
    Starts offloaded: call `onload(["params"])` (and "optimizer" before training) first.
    """

    _ref_params: list[torch.Tensor] | None
    _weight_group = None  # rank 0's roles.weight_broadcast.WeightGroup, with engines on other nodes

    def _parameters(self) -> list[torch.Tensor]:
        """The model's parameters, in the order of `_ref_params`."""
        raise NotImplementedError

    def _log_prob_fn(self):
        """What the core's forward_only computes log-probs with, at the rollout temperature."""
        raise NotImplementedError

    def _objective(self):
        """What the core's train trains: the PPO policy objective (roles.trainer.objectives)."""
        raise NotImplementedError

    def named_weights(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor in the compute dtype) for every parameter, as the checkpoint names them.

        Tied weights appear once, under the name the HF checkpoint stores. `views` (the weight
        sync only): a backend may give a tensor that no view of its parameters shapes as HF does
        as a roles.weight_views.LazyReshape instead of a copy (megatron's q/k/v at TP1).
        """
        raise NotImplementedError

    # ---- forward ------------------------------------------------------------------------

    @endpoint
    def compute_log_probs(self, batch: dict) -> dict:
        """{"log_probs": float32 [N, R]} under the current policy, at the rollout temperature."""
        return {"log_probs": self._core.forward_only(batch, self._log_prob_fn())}

    @endpoint
    def compute_ref_log_probs(self, batch: dict) -> dict:
        """{"log_probs": float32 [N, R]} under the reference (initial) policy."""
        if self._ref_params is None:
            raise RuntimeError("compute_ref_log_probs needs the reference copy; build the actor with keep_ref=True")
        self._core.require_onloaded("params")
        with self._swapped_in(self._ref_params):
            return {"log_probs": self._core.forward_only(batch, self._log_prob_fn())}

    @contextlib.contextmanager
    def _swapped_in(self, weights: list[torch.Tensor]) -> Iterator[None]:
        params = self._parameters()
        backup = [p.detach().to("cpu", copy=True) for p in params]
        with torch.no_grad():
            for param, w in zip(params, weights):
                param.copy_(w, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, b in zip(params, backup):
                    param.copy_(b, non_blocking=True)

    # ---- training -----------------------------------------------------------------------

    @endpoint
    def train(self, batch: dict, mini_batches: list[dict] | None = None) -> dict:
        """One PPO pass over the batch; metrics (miles names) averaged over optimizer steps:
        pg_loss, pg_clipfrac, ppo_kl, entropy_loss (when entropy_coef != 0 or log_entropy),
        kl_loss (when use_kl_loss), grad_norm, lr (of the last step), skipped_nonfinite.
        `mini_batches`: a rank's share of each mini-batch (roles.trainer.group)."""
        required = ACTOR_TRAIN_KEYS + (("ref_log_probs",) if self.config.use_kl_loss else ()) + optional_train_keys(batch)
        return self._train(batch, required, self._objective(), mini_batches)

    # ---- weights ------------------------------------------------------------------------

    @endpoint
    def weights_checksum(self) -> dict[str, str]:
        """HF name -> exact digest of the weights an engine would receive."""
        return checksum_named_tensors(self.named_weights())

    @endpoint
    def join_weight_group(self, master_addr: str, master_port: int, world_size: int, backend: str) -> None:
        """Rank 0 joins the weight broadcast group (roles.weight_broadcast) as its rank 0, with
        the engines on other nodes after it; the other ranks send no weights and do nothing."""
        if is_rank_zero():
            from roles.weight_broadcast import WeightGroup

            self._weight_group = WeightGroup.join(master_addr, master_port, world_size, 0, backend)

    @endpoint
    def sync_weights(self, engines: list, buffer_bytes: int, version: int, timeout_s: float = 600.0,
                     engine_gpus: list[list[int]] | None = None, by_broadcast: list[bool] | None = None) -> dict:
        """Stream the weights to every engine bucket by bucket, then set their weight version.

        Each bucket goes to all engines at once (`roles.weight_sync.send_to_engines`), double
        buffered: the next bucket is packed while the engines load this one, and a buffer is
        packed again only after every engine acked its last bucket; an engine's error or a
        timeout (`timeout_s` per ack) ends the sync and is raised. On a GPU, engines on the
        same physical GPU (`engine_gpus`, physical ids) get CUDA IPC handles; engines on other
        nodes (`by_broadcast`) get each bucket's tensor by the weight group's broadcast. In a rank
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
                                 timeout_s=timeout_s, memory=self._core.memory if resident else None, on_bucket=acked,
                                 group=self._weight_group, by_broadcast=by_broadcast)
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

