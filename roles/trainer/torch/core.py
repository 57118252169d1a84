"""The torch backend's core, one per trainer: the model's memory, the optimizer, the train step.

One `train` call is one pass over a rollout batch (roles.trainer.steps.train_pass): one
optimizer step per mini-batch, gradients accumulated over micro-batches. Micro-batch losses
are aggregated with the whole mini-batch's sample and token counts (algorithms.aggregate's
sharding contract), so they sum to the loss of the mini-batch in one piece, however it was
split.

Data parallel (a rank of a group, roles.trainer.group): the rank gets its share of each
mini-batch and the global counts; after its micro-batches it all-reduces the gradients
and the loss and metric sums (SUM, roles.trainer.distributed), so every rank steps on the
gradient of the whole mini-batch, skips the same steps, and reports the same metrics.
This is DDP's no_sync-then-sync schedule without its overlap of communication and
backward; DDP itself does not fit here: its reducer keeps grad-sized buckets on the device
it was built on, but a trainer moves its parameters between the CPU and the GPU, and the
forwards bypass the model's forward(), where DDP hooks in.

Memory: the trainer starts with everything on the CPU and nothing accounted, so that it
can be built while another role holds the GPU lease; `onload(["params", "optimizer"])`
before computing. Three tags are accounted with roles.device.DeviceMemory:
  params     master weights (float32) and buffers
  optimizer  AdamW state; torch creates it at the first step, accounted from then on
  grads      exist only inside train (freed with set_to_none after each step), accounted
             while they exist; offloading them therefore never has anything to move
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterator

import torch
from torch import nn

from roles.device import DeviceMemory, check_memory_tags
from roles.model_spec import ModelSpec
from roles.phase_memory import micro_batch_bytes, model_config
from roles.trainer.batching import (
    MicroBatch,
    check_batch,
    collate,
    plan_micro_batches,
    response_mask,
    scatter_rows,
    sequences,
)
from roles.trainer.checkpoint import load_checkpoint, save_checkpoint
from roles.trainer.config import MEMORY_TAGS, TrainerConfig
from roles.trainer.distributed import all_reduce_floats, all_reduce_sum_, is_rank_zero
from roles.trainer.torch.optim import build_adamw, clip_grad_norm, is_state_tensor, optimizer_state_bytes, set_lr
from roles.trainer.rng import capture_rng, restore_rng
from roles.trainer.steps import LOSS, sum_metrics, train_pass


# (micro-batch, aggregation counts of its mini-batch) -> (loss, metrics). Metrics must be
# scaled so that summing them over the micro-batches of a mini-batch gives its value.
MicroLoss = Callable[[MicroBatch, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


class TrainCore:
    """Model, optimizer, lr schedule and device memory of one trainer."""

    def __init__(self, config: TrainerConfig, model: nn.Module, memory: DeviceMemory):
        self.config = config
        self.model = model
        config_hf, self._has_lm_head = model_config(model)
        self.spec = ModelSpec.from_hf(config_hf)  # the refusals every backend shares (roles.model_spec)
        self.memory = memory
        self.optimizer = build_adamw(
            model, lr=config.lr, weight_decay=config.weight_decay, betas=config.betas, eps=config.adam_eps
        )
        self.schedule = config.lr_schedule_fn
        self.step = 0  # optimizer steps taken (roles.trainer.steps counts them)
        self.offloaded = {"params", "optimizer"}

    # ---- memory -------------------------------------------------------------------------

    def offload(self, tags: list[str]) -> dict:
        """Move the tagged state to (pinned) CPU memory; returns the ledger and bytes in use."""
        return self._place(tags, "cpu")

    def onload(self, tags: list[str]) -> dict:
        """Bring the tagged state onto the device (the caller holds the GPU lease)."""
        return self._place(tags, "device")

    def _place(self, tags: list[str], where: str) -> dict:
        check_memory_tags(tags, MEMORY_TAGS)
        # "grads" has nothing to move: grads exist only inside train (see the module note).
        for tag in ("params", "optimizer"):
            if tag not in tags:
                continue
            if tag == "params":
                self.memory.move(self.model, where, tag="params")
            else:
                self._move_optimizer_state(where)
            if where == "cpu":
                self.offloaded.add(tag)
            else:
                self.offloaded.discard(tag)
        return {"ledger": self.memory.ledger(), "bytes_in_use": self.memory.bytes_in_use()}

    def _move_optimizer_state(self, where: str) -> None:
        states = list(self.optimizer.state.values())
        keys = [[k for k, v in s.items() if is_state_tensor(v)] for s in states]
        tensors = [s[k] for s, ks in zip(states, keys) for k in ks]
        moved = iter(self.memory.move(tensors, where, tag="optimizer"))
        for s, ks in zip(states, keys):
            for k in ks:
                s[k] = next(moved)

    def require_onloaded(self, *tags: str) -> None:
        missing = [t for t in tags if t in self.offloaded]
        if missing:
            raise RuntimeError(
                f"{missing} offloaded; call onload({missing}) first (the trainer starts offloaded "
                "so that it can be built while another role holds the GPU lease)"
            )

    # ---- forward-only -------------------------------------------------------------------

    def micro_batches(
        self, batch: dict, indices: list[int], seqs: list[torch.Tensor], response_keys: tuple[str, ...]
    ) -> Iterator[MicroBatch]:
        lengths = [len(seqs[i]) for i in indices]
        for group in plan_micro_batches(
            lengths, micro_batch_size=self.config.micro_batch_size, max_tokens=self.config.max_tokens_per_gpu
        ):
            yield collate(seqs, batch, [indices[g] for g in group], response_keys)

    @torch.no_grad()
    def forward_only(self, batch: dict, fn: Callable[[MicroBatch], torch.Tensor]) -> torch.Tensor:
        """fn's response-aligned output over the whole batch, [N, R] float32, zero at padding."""
        self.require_onloaded("params")
        n = check_batch(batch, ())
        seqs = sequences(batch)
        self.model.eval()
        parts = []
        for mb in self.micro_batches(batch, list(range(n)), seqs, ()):
            with self._charged(mb, training=False):
                parts.append((mb.indices, fn(mb).cpu()))
        out = scatter_rows(parts, n, int(batch["response_lens"].max()))
        return torch.where(response_mask(batch["response_lens"], out.shape[1]), out, 0.0)

    # ---- training -----------------------------------------------------------------------

    def train(self, batch: dict, required: tuple[str, ...], micro_loss: MicroLoss,
              mini_batches: list[dict] | None = None) -> dict:
        """One pass over `batch` (roles.trainer.steps.train_pass); `mini_batches`: a data-parallel
        rank's plan (the rank contract in roles.trainer.group), None when `batch` is the whole batch."""
        self.require_onloaded("params", "optimizer")
        self.model.train()

        def accumulate(seqs: list[torch.Tensor], rows: list[int], counts: dict) -> dict[str, float]:
            stores = []
            for mb in self.micro_batches(batch, rows, seqs, required):
                with self._charged(mb, training=True):
                    loss, metrics = micro_loss(mb, counts)
                    loss.backward()
                self._account_grads()
                stores.append({**metrics, LOSS: loss.detach()})
            return self._reduce_over_ranks(sum_metrics(stores))

        return train_pass(self, batch, required, mini_batches, accumulate)

    def apply_step(self, loss: float, lr: float) -> tuple[float, bool]:
        """roles.trainer.steps.StepBackend.apply_step; the grads are freed (set_to_none)."""
        grad_norm = clip_grad_norm(self.model, self.config.clip_grad) if math.isfinite(loss) else math.nan
        stepped = math.isfinite(loss) and math.isfinite(grad_norm)
        if stepped:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.memory.account("optimizer", optimizer_state_bytes(self.optimizer))
        self.optimizer.zero_grad(set_to_none=True)
        self.memory.account("grads", 0)
        return grad_norm, stepped

    def _charged(self, mb: MicroBatch, *, training: bool):
        """The micro-batch's activations and logits, charged while it is computed."""
        nbytes = micro_batch_bytes(self.spec, num_tokens=mb.input_ids.numel(),
                                   num_logit_tokens=len(mb.indices) * mb.response_width,
                                   width=self.config.torch_dtype.itemsize, training=training,
                                   gradient_checkpointing=self.config.gradient_checkpointing,
                                   with_logits=self._has_lm_head)
        return self.memory.transient("activations", nbytes, phase="train" if training else "forward")

    def _reduce_over_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """Sum the gradients and the loss and metric sums over the data-parallel ranks (no-op alone)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        all_reduce_sum_(grads)
        total = all_reduce_floats({**sums, "__num_grads": len(grads), "__one": 1})
        assert total.pop("__num_grads") == len(grads) * total.pop("__one"), \
            "data-parallel ranks disagree on which parameters have gradients"
        return total

    def _account_grads(self) -> None:
        nbytes = sum(p.grad.numel() * p.grad.element_size() for p in self.model.parameters() if p.grad is not None)
        if nbytes != self.memory.ledger().get("grads", 0):  # a fake-GPU ledger write takes a file lock
            self.memory.account("grads", nbytes)

    # ---- checkpoints --------------------------------------------------------------------

    def save(self, path: str) -> dict:
        """Weights (safetensors, the model's parameter names), optimizer state, step and RNG
        state, written atomically. In a rank group rank 0 writes (the replicas are equal); the
        others return at once."""
        if not is_rank_zero():
            return {"path": path, "step": self.step, "seconds": 0.0}
        start = time.monotonic()
        save_checkpoint(path, weights=dict(self.model.named_parameters()), optimizer=self.optimizer.state_dict(),
                        step=self.step, rng=capture_rng())
        return {"path": path, "step": self.step, "seconds": time.monotonic() - start}

    def load(self, path: str) -> dict:
        """Restore the weights (in place), optimizer state, step and RNG state.

        Nothing is changed unless every name and shape matches the model.
        """
        named_params = dict(self.model.named_parameters())
        ckpt = load_checkpoint(path)
        if set(ckpt.weights) != set(named_params):
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {sorted(set(named_params) - set(ckpt.weights))}, "
                f"unexpected {sorted(set(ckpt.weights) - set(named_params))}"
            )
        shapes = [f"{name}: checkpoint {list(ckpt.weights[name].shape)}, model {list(p.shape)}"
                  for name, p in named_params.items() if ckpt.weights[name].shape != p.shape]
        if shapes:
            raise ValueError(f"checkpoint {path} does not match the model's shapes: {shapes[:5]}"
                             + (f" and {len(shapes) - 5} more" if len(shapes) > 5 else ""))
        with torch.no_grad():
            for name, param in named_params.items():
                param.copy_(ckpt.weights[name])
        # load_state_dict puts the state on its params' device; re-place it to match our flags.
        self.optimizer.load_state_dict(ckpt.optimizer)
        self._move_optimizer_state("cpu" if "optimizer" in self.offloaded else "device")
        self.step = ckpt.step
        restore_rng(ckpt.rng)
        return {"path": path, "step": self.step}
