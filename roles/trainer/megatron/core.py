"""What the megatron actor and critic share: parallel state, the GPTModel under megatron's
DDP and optimizer, packed forward passes, the train loop, offload by tag.

Needs megatron-core (Python >= 3.12) and CUDA; imported lazily by roles.trainer.megatron.

Parallelism (megatron's parallel_state; rank order tp, cp, dp, pp):
  TP  weights sharded by the mapper; log-probs from the vocab-parallel output weight
      (roles.trainer.megatron.logprobs); the critic's value head is replicated; no
      sequence parallelism (roles.trainer.megatron.shape says why)
  CP  each packed micro-batch is padded per sample to a multiple of 2*cp and sliced by
      megatron's load-balanced layout (roles.trainer.megatron.cp); per-row outputs are
      gathered back in row order on every CP rank, which then computes the same loss
  PP  megatron's schedule (get_forward_backward_func, variable sequence lengths) runs every
      forward and backward, train and forward-only; results and metrics come from the last
      stage. The weights leave through rank 0 (stage 0): each later stage maps its own
      layers to HF names (global layer offsets) and broadcasts them over its pipeline group
      one tensor at a time (roles.trainer.megatron.export). Proof on one GPU:
      tests/test_megatron_gpu_parallel.py (its docstring says what stands in for NCCL).
Micro-batches hold up to max_tokens_per_gpu * cp tokens (each CP rank runs 1/cp of them),
as miles plans them.

Train step: the skeleton of roles.trainer.steps (shared with the torch backend), the rank
contract of roles.trainer.group and the aggregation of roles.trainer.objectives: each
micro-batch loss is divided by the WHOLE mini-batch's counts, so gradients are summed over
micro-batches and data-parallel ranks. megatron's DDP sums when
calculate_per_token_loss is set (no 1/dp scaling), and finalize_model_grads is called
without a token count (no 1/tokens scaling). The optimizer is megatron's (distributed
optimizer: float32 main params and Adam state sharded over dp; torch AdamW without apex or
transformer-engine); a step is skipped when the global loss or grad norm is not finite.

Memory tags (roles.trainer.megatron.offload):
  params     DDP's param buffers (compute dtype) - the weights the forward and the sync read
  grads      DDP's grad buffers (float32), freed on offload, zeroed on onload
  optimizer  float32 main params and Adam moments
The trainer is built on the GPU (megatron's DDP allocates its buffers there) and
offloads everything at the end of construction, so it needs the device while it starts.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from roles.device import DeviceMemory, check_memory_tags
from roles.model_spec import ModelSpec
from roles.trainer.batching import check_batch, response_mask, scatter_rows, sequences
from roles.trainer.megatron.config import MEMORY_TAGS, MegatronTrainerConfig
from roles.trainer.megatron.cp import CPSlice, cp_slice, gather_rows
from roles.trainer.megatron.env import (
    compile_in_process,
    drop_rotary_cache,
    init_parallel,
    load_hf_state,
    use_fused_adam,
)
from roles.trainer.megatron.export import all_gather_shards, model_hf_weights
from roles.trainer.megatron.mapper import hf_to_megatron
from roles.trainer.megatron.model import build_gpt_model, use_transformer_engine
from roles.trainer.megatron.offload import TaggedOffloader
from roles.trainer.megatron.packing import PackedMicroBatch, pack, plan_packed
from roles.trainer.megatron.shape import megatron_spec, transformer_config_kwargs
from roles.trainer.steps import LOSS, sum_metrics, train_pass

# Above this much device memory outside the tags a report lists the largest blocks: below it
# (the fused Adam's step counters, norms' flags) listing costs a snapshot and says nothing.
UNTRACKED_NOTE = 1 << 20

# processor(hidden [nr, H] at this rank's response rows, their targets [nr], output weight
# or None, output layer) -> a tuple of [nr] tensors, or None for an output not asked for
Processor = Callable[..., tuple[torch.Tensor | None, ...]]


class MegatronObjective(Protocol):
    """What a role trains: the processor of a micro-batch's forward and the loss of its outputs."""

    def processor(self, mb: PackedMicroBatch) -> Processor: ...

    def loss(self, out, mb: PackedMicroBatch, counts: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics) as roles.trainer.objectives gives them, from `forward`'s outputs."""


class MegatronCore:
    """One trainer's model, optimizer, memory and train loop (actor: critic=False)."""

    def __init__(self, config: MegatronTrainerConfig, *, critic: bool, memory: DeviceMemory,
                 hf_state: dict[str, torch.Tensor] | None = None):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from transformers import AutoConfig

        from megatron.core import parallel_state as ps

        self.config, self.critic, self.memory = config, critic, memory
        init_parallel(config)
        compile_in_process()
        self.shape: ModelSpec = megatron_spec(AutoConfig.from_pretrained(config.hf_checkpoint))
        self.tp_size, self.cp_size = config.tensor_model_parallel_size, config.context_parallel_size
        self.pp_size = config.pipeline_model_parallel_size
        self.shape.check_parallel(tp_size=self.tp_size, pp_size=self.pp_size)
        self.tp_rank, self.cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        self.cp_group = ps.get_context_parallel_group() if self.cp_size > 1 else None
        self.dp_group = ps.get_data_parallel_group()  # without CP: CP peers report the same metrics
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp_size > 1 else None
        self._sync_views: tuple | None = None  # (storages, named_hf_weights(views=True)) at TP1, one stage
        self.last_stage = ps.is_pipeline_last_stage()
        self.use_te = use_transformer_engine(config.transformer_impl)
        self.spec = "te" if self.use_te else "local"
        tconfig = TransformerConfig(
            **transformer_config_kwargs(
                self.shape, tp_size=config.tensor_model_parallel_size, pp_size=config.pipeline_model_parallel_size,
                cp_size=config.context_parallel_size, dtype=config.dtype,
                recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                recompute_num_layers=config.recompute_num_layers),
            calculate_per_token_loss=True,  # DDP sums gradients (see the module note)
            perform_initialization=False,  # every weight is loaded from the HF state below
        )
        model = build_gpt_model(self.shape, tconfig, tp_size=self.tp_size, critic=critic, use_te=self.use_te,
                                pre_process=ps.is_pipeline_first_stage(), post_process=self.last_stage)
        self._load_hf(model, hf_state if hf_state is not None else self._initial_hf_state())
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=config.use_distributed_optimizer)
        self.ddp = DistributedDataParallel(tconfig, ddp_config, model)
        self.module = model
        self.device = next(model.parameters()).device
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
                adam_beta1=config.betas[0], adam_beta2=config.betas[1], adam_eps=config.adam_eps,
                clip_grad=config.clip_grad, bf16=config.dtype == "bfloat16", fp16=config.dtype == "float16",
                params_dtype=tconfig.params_dtype, use_distributed_optimizer=config.use_distributed_optimizer),
            [self.ddp],
        )
        if self.device.type == "cuda":
            use_fused_adam(self._optimizers())
        from megatron.core.distributed import finalize_model_grads

        # Sum, never average, over dp: finalize without a token count (module note).
        tconfig.finalize_model_grads_func = lambda models, *args, **kw: finalize_model_grads(models, None)
        tconfig.no_sync_func = self.ddp.no_sync
        tconfig.grad_scale_func = self.optimizer.scale_loss if config.dtype == "float16" else None  # loss scaling
        self.tconfig = tconfig
        self.schedule = config.lr_schedule_fn
        self.step = 0
        self.offloader = TaggedOffloader(memory)
        # the params' sizes never change: a run that offloads them every iteration keeps their first block
        self.offloader.register("params", self._param_tensors, keep_first="params" in config.offload_tags)
        self.offloader.register("grads", lambda: [b.grad_data for b in self.ddp.buffers], keep=False)
        self.offloader.register("optimizer", self._optimizer_tensors)
        # The actor's reference policy is its initial weights: a CPU copy, swapped in for ref log-probs.
        self.ref_params = ([p.detach().to("cpu", copy=True) for p in model.parameters()]
                           if config.keep_ref and not critic else None)
        for tag in MEMORY_TAGS:
            self.memory.account(tag, self.offloader.nbytes(tag))
        self.offload(list(MEMORY_TAGS))

    # ---- weights ------------------------------------------------------------------------

    def _initial_hf_state(self) -> dict[str, torch.Tensor]:
        hf = load_hf_state(self.config.hf_checkpoint)
        if not self.critic:
            return hf
        # The critic: the checkpoint's trunk and a fresh value head (seeded as the torch backend's).
        state = {"backbone." + k.removeprefix("model."): v for k, v in hf.items() if k.startswith("model.")}
        gen = torch.Generator().manual_seed(self.config.seed)
        from roles.trainer.megatron.model import VALUE_HEAD_INIT_STD

        state["value_head.weight"] = torch.empty(1, self.shape.hidden_size).normal_(0.0, VALUE_HEAD_INIT_STD,
                                                                                     generator=gen)
        state["value_head.bias"] = torch.zeros(1)
        return state

    def _load_hf(self, model: torch.nn.Module, hf: dict[str, torch.Tensor]) -> None:
        target = hf_to_megatron(hf, self.shape, tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank,
                                pp_size=self.pp_size, spec=self.spec, critic=self.critic)
        params = dict(model.named_parameters())
        if set(params) != set(target):
            raise ValueError(f"megatron model and mapper disagree: model only {sorted(set(params) - set(target))[:5]}, "
                             f"mapper only {sorted(set(target) - set(params))[:5]}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(target[name])

    @property
    def gathers_weights(self) -> bool:
        """Whether this rank takes part in gathering the full weights: the TP and pipeline
        groups of dp rank 0, CP rank 0 (the other dp and CP ranks hold replicas)."""
        return self.dp_rank == 0 and self.cp_rank == 0

    def named_hf_weights(self, views: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor in the compute dtype), the TP shards all-gathered: on pipeline
        stage 0 the whole model, stage by stage; on a later stage its own stage's weights
        (roles.trainer.megatron.export). A collective over the TP and pipeline groups: every
        rank for which `gathers_weights` holds consumes it whole, in step with its peers.
        `views` (the weight sync): q/k/v at TP1 as LazyReshapes of the parameters (mapper.to_hf).

        With views at TP1 on one stage every pair is a view of a parameter (no gather, no
        broadcast, no copy), valid while the parameters' storages are the same objects
        (offloads resize them, checkpoint loads copy into them): the list is mapped once per
        set of storages and reused by every sync, which would otherwise map ~400 parameters
        before its first byte moves (1.5 of the 2.6 ms of mapping and listing on our CI
        CPU)."""
        if views and self.tp_group is None and self.pp_group is None:
            key = tuple(t.untyped_storage()._cdata for t in self._param_tensors())  # same across resize_
            if self._sync_views is None or self._sync_views[0] != key:
                self._sync_views = (key, list(self._hf_weights(views=True)))
            return iter(self._sync_views[1])
        return self._hf_weights(views=views)

    def _hf_weights(self, views: bool) -> Iterator[tuple[str, torch.Tensor]]:
        return model_hf_weights({n: p.detach() for n, p in self.module.named_parameters()}, self.shape,
                                tp_size=self.tp_size, tp_shards=lambda name, t: all_gather_shards(t, self.tp_group),
                                pp_group=self.pp_group, pp_rank=self.pp_rank, pp_size=self.pp_size, spec=self.spec,
                                critic=self.critic, device=self.device, views=views)

    def tied_embedding_copy(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On the last stage of a pipelined model with tied embeddings, its copy of the
        embedding (the output layer's weight, which megatron keeps equal to stage 0's by an
        all-reduce of their grads), TP shards all-gathered, as the HF embedding; elsewhere
        nothing. The export leaves it out (the engines load one embedding), so this is how a
        check sees the two copies drift apart. A collective over the TP group."""
        if self.pp_group is None or not self.last_stage or not self.shape.tied_embeddings or self.critic:
            return
        from roles.trainer.megatron.mapper import to_hf

        weight = self.module.output_layer.weight.detach()
        yield from to_hf("embedding.word_embeddings.weight", all_gather_shards(weight, self.tp_group), self.shape,
                         layer_offset=0, spec=self.spec)

    def _param_tensors(self) -> list[torch.Tensor]:
        """DDP's flat param buffers (distributed optimizer), else the parameters themselves."""
        flat = [b.param_data for b in self.ddp.buffers if b.param_data is not None]
        return flat or [p.data for p in self.module.parameters()]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        out = self._main_params()
        for opt in self._optimizers():
            for state in opt.optimizer.state.values():
                # the fused kernel's 0-dim step counters stay on the device (~400 x 512 B:
                # within the lease check's untracked allowance)
                out += [v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0]
        return out

    def _optimizers(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def _main_params(self) -> list[torch.Tensor]:
        """float32 main params: the distributed optimizer's shards, or the plain mixed-precision copies."""
        out = []
        for opt in self._optimizers():
            main = getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", [])
            for group in main:
                out += [p.data for p in group]
        return out

    # ---- memory -------------------------------------------------------------------------

    @property
    def offloaded(self) -> set[str]:
        return self.offloader.offloaded

    def offload(self, tags: list[str]) -> dict:
        return self._place(tags, self.offloader.offload)

    def onload(self, tags: list[str]) -> dict:
        return self._place(tags, self.offloader.onload)

    def _place(self, tags: list[str], move) -> dict:
        check_memory_tags(tags, MEMORY_TAGS)
        moves = {tag: move(tag) for tag in tags}
        drop_rotary_cache()
        torch.cuda.empty_cache()
        report = {"ledger": self.memory.ledger(), "bytes_in_use": self.memory.bytes_in_use(), "moves": moves}
        if report["bytes_in_use"] - sum(report["ledger"].values()) > UNTRACKED_NOTE:
            report["untracked"] = self.offloader.untracked_blocks()[:5]
        return report

    def require_onloaded(self, *tags: str) -> None:
        missing = [t for t in tags if t in self.offloaded]
        if missing:
            raise RuntimeError(f"{missing} offloaded; call onload({missing}) first (the trainer starts offloaded)")

    # ---- forward ------------------------------------------------------------------------

    def forward(self, module, mb: PackedMicroBatch, processor: Processor):
        """Run this rank's slice of the packed micro-batch (all of it without CP). On the last
        pipeline stage: `processor`'s outputs at the micro-batch's response rows, each [Nr] in
        row order (gathered over CP; an output not asked for is an empty tensor); on other
        stages the hidden states for the next."""
        from megatron.core.packed_seq_params import PackedSeqParams

        dev = self.device
        piece = self.slice(mb)
        cu = mb.cu_seqlens.to(dev)  # whole (padded) sequences, as the attention and THD RoPE expect with CP
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)

        def output_processor(*, hidden_states, output_layer, output_weight, **_):
            hidden = hidden_states[:, 0][piece.local_rows.to(dev)]  # [t, 1, H] -> [nr, H]
            outs = processor(hidden, piece.targets.to(dev), output_weight, output_layer)
            # a tuple of tensors: megatron's wrappers walk outputs and cannot take None
            return tuple(hidden.new_zeros(0, dtype=torch.float32) if o is None else gather_rows(o, piece, self.cp_group)
                         for o in outs)

        return module(piece.input_ids.to(dev)[None], piece.position_ids.to(dev)[None], None,
                      packed_seq_params=params, output_processor=output_processor)

    def slice(self, mb: PackedMicroBatch) -> CPSlice:
        return cp_slice(mb, self.cp_size, self.cp_rank)

    def micro_batches(self, batch: dict, indices: list[int], seqs, keys: tuple[str, ...]) -> list[PackedMicroBatch]:
        max_tokens = self.config.max_tokens_per_gpu
        plan = plan_packed([len(seqs[i]) for i in indices], micro_batch_size=self.config.micro_batch_size,
                           max_tokens=None if max_tokens is None else max_tokens * self.cp_size)
        pad = 2 * self.cp_size if self.cp_size > 1 else 1
        return [pack(seqs, batch, [indices[g] for g in group], keys, pad_multiple=pad) for group in plan]

    def _run(self, mbs: list[PackedMicroBatch], processor: Callable[[PackedMicroBatch], Processor],
             on_output: Callable, *, forward_only: bool) -> list[dict]:
        """megatron's forward(-backward) schedule over `mbs`; `on_output(out, mb)` on the last
        stage returns (loss, metrics) as loss_func does. The per-micro-batch metric stores."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            out = self.forward(model, mb, processor(mb))

            def loss_func(out_tensor):
                value, metrics = on_output(out_tensor, mb)
                reported = {k: v.detach().float().reshape(()) for k, v in metrics.items()}
                reported[LOSS] = value.detach().float()
                return value, torch.ones((), dtype=torch.int, device=value.device), reported

            return out, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[self.ddp], num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens // self.cp_size for mb in mbs), micro_batch_size=1, forward_only=forward_only)

    @torch.no_grad()
    def forward_only(self, batch: dict, processor: Callable[[PackedMicroBatch], Processor]) -> torch.Tensor:
        """The processor's first output over the whole batch, [N, R] float32, zero at padding
        (zeros on pipeline stages other than the last: they are not output ranks)."""
        self.require_onloaded("params")
        n = check_batch(batch, ())
        seqs = sequences(batch)
        self.ddp.eval()
        parts: list[tuple[list[int], torch.Tensor]] = []

        def keep(out, mb):
            parts.append((mb.indices, mb.to_rows(out[0]).float().cpu()))
            return out[0].new_zeros(()), {}

        self._run(self.micro_batches(batch, list(range(n)), seqs, ()), processor, keep, forward_only=True)
        width = int(batch["response_lens"].max())
        if not parts:
            return torch.zeros(n, width)
        out = scatter_rows(parts, n, width)
        return torch.where(response_mask(batch["response_lens"], out.shape[1]), out, 0.0)

    # ---- training -----------------------------------------------------------------------

    def train(self, batch: dict, required: tuple[str, ...], objective: MegatronObjective,
              mini_batches: list[dict] | None = None) -> dict:
        """One pass over `batch` (roles.trainer.steps.train_pass, as TrainCore.train):
        `objective.processor(mb)` is the processor for `forward`, `objective.loss(out, mb,
        counts)` the micro-batch loss."""
        self.require_onloaded("params", "grads", "optimizer")
        self.ddp.train()
        self._zero_grads()

        def accumulate(seqs: list[torch.Tensor], rows: list[int], counts: dict) -> dict[str, float]:
            stores = self._run(self.micro_batches(batch, rows, seqs, required), objective.processor,
                               lambda out, mb: objective.loss(out, mb, counts), forward_only=False)
            return self._reduce_metrics(stores)

        return train_pass(self, batch, required, mini_batches, accumulate)

    def _reduce_metrics(self, stores: list[dict]) -> dict[str, float]:
        """A mini-batch's metric sums over its micro-batches and dp ranks, on every rank. TP and
        CP peers computed the same (replicated) loss, so only dp is summed; only the last
        pipeline stage has them, so it broadcasts them over its pipeline group."""
        sums = sum_metrics(stores)
        if self.pp_group is not None:
            box = [sums]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(self.pp_group)[-1], group=self.pp_group)
            sums = box[0]
        if dist.get_world_size(self.dp_group) == 1:
            return sums
        keys = sorted(sums)
        flat = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(flat, group=self.dp_group)
        return dict(zip(keys, flat.tolist()))

    def _zero_grads(self) -> None:
        """Zero DDP's grad buffer and drop every `.grad`: a non-distributed megatron optimizer
        points param.grad at main_grad in prepare_grads, and a `.grad` left there would be
        accumulated into main_grad a second time by DDP's hook at the next backward."""
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    def apply_step(self, loss: float, lr: float) -> tuple[float, bool]:
        """roles.trainer.steps.StepBackend.apply_step; the grad norm is NaN when the step is skipped."""
        grad_norm = math.nan
        # prepare_grads unscales (fp16) and says whether the grads hold an inf or NaN
        if math.isfinite(loss) and not self.optimizer.prepare_grads():
            grad_norm = float(self.optimizer.get_grad_norm())
        stepped = math.isfinite(grad_norm)
        if stepped:
            if self.config.clip_grad > 0:
                self.optimizer.clip_grad_norm(self.config.clip_grad)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
                # what megatron's lr scheduler (not built here) sets each step: its groups of
                # biases and 1-D weights carry wd_mult 0, and the optimizer's own weight_decay is
                # the config's for every group until someone applies it (the torch backend
                # leaves the same weights undecayed: roles.trainer.torch.optim)
                group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)
            self.optimizer.step_with_ready_grads()
            self.memory.account("optimizer", self.offloader.nbytes("optimizer"))  # Adam state exists from step 1
        self._zero_grads()
        return (grad_norm if stepped else math.nan), stepped

    # ---- checkpoints --------------------------------------------------------------------

    def save(self, path: str) -> dict:
        """HF-named weights, step and RNG (roles.trainer.checkpoint) by dp rank 0, plus each rank's
        optimizer shard (main params and Adam state, this layout only) as optimizer.rank<r>.pt."""
        from roles.trainer.checkpoint import save_checkpoint
        from roles.trainer.rng import capture_rng

        start = time.monotonic()
        self.require_onloaded("params", "optimizer")
        rank = dist.get_rank()
        if self.gathers_weights:  # rank 0 and its TP and pipeline peers; rank 0 gets every stage
            weights = {k: v.detach().cpu() for k, v in self.named_hf_weights()}
            if rank == 0:
                save_checkpoint(path, weights=weights, optimizer={}, step=self.step, rng=capture_rng())
        dist.barrier()
        # the inner torch optimizers' state: Adam moments AND their step counters (bias correction)
        torch.save({"main_params": [t.cpu() for t in self._main_params()],
                    "adam": [opt.optimizer.state_dict()["state"] for opt in self._optimizers()], "step": self.step},
                   os.path.join(path, f"optimizer.rank{rank}.pt"))
        dist.barrier()
        return {"path": path, "step": self.step, "seconds": time.monotonic() - start}

    def load(self, path: str) -> dict:
        from roles.trainer.checkpoint import load_checkpoint
        from roles.trainer.rng import restore_rng

        self.require_onloaded("params", "optimizer")
        ckpt = load_checkpoint(path)
        self._load_hf(self.module, ckpt.weights)
        shard = torch.load(os.path.join(path, f"optimizer.rank{dist.get_rank()}.pt"), map_location="cpu")
        main = self._main_params()
        if [t.shape for t in main] != [t.shape for t in shard["main_params"]]:
            raise ValueError(f"{path}: optimizer shard does not match this trainer's layout (same dp size needed)")
        with torch.no_grad():
            for t, saved in zip(main, shard["main_params"]):
                t.copy_(saved)
        for opt, state in zip(self._optimizers(), shard["adam"]):
            # a fresh optimizer has no Adam state yet: load_state_dict creates it on the params' device
            opt.optimizer.load_state_dict({**opt.optimizer.state_dict(), "state": state})
        self.memory.account("optimizer", self.offloader.nbytes("optimizer"))
        self.step = ckpt.step
        restore_rng(ckpt.rng)
        return {"path": path, "step": self.step}
