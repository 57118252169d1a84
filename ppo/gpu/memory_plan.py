"""The memory plan: for each GPU and each phase of a PPO iteration, the bytes each role holds
there by kind, and the peak, from the model spec and the config alone (no process starts).

What a role holds in a phase follows the loop (ppo.loop.steps) and the handoffs
(ppo.gpu.colocation, ppo.gpu.handoffs): the tenant whose turn it is holds its working state, every
other tenant sharing the GPU holds what its offload tags leave resident (`--offload-train-level`,
`--offload-rollout-level`). Start-up has a phase per megatron trainer: it builds on the GPU
(params, grads, float32 main params; Adam's moments appear at the first step) under the GPU's
lease, then offloads everything before the next one builds (ppo.setup.job).

Sizes, per GPU (P: the parameters a rank holds, from the spec; w: the compute dtype's bytes):

    kind          megatron                               torch backend
    weights       P x w (DDP's param buffer)             P x w + RoPE buffers
    grads         P x 4 (grad_reduce_in_fp32)            P x w, inside train only
    optimizer     P x 12 / dp (fp32 main params, Adam),  P x 2w (Adam's moments)
                  less --optimizer-offload-fraction
                  with --optimizer-cpu-offload
    activations   roles.phase_memory.micro_batch_bytes of the largest micro-batch
    kv_cache      the engine's budget: mem_fraction x GPU - its weights on a GPU, else
                  max_batch_size rows of the full context (roles.rollout.torch_engine.backend)
    sync_buffers  the actor's bucket buffers in the weight sync: one per bucket, at most two
                  (double buffering), each --update-weight-buffer-size (roles.weight_sync)
    slack         on a real GPU, what the computing trainer's allocator keeps reserved but cannot
                  hand out (blocks freed by earlier micro-batches): ALLOCATOR_SLACK of its bytes
    cuda_context  each process's device memory outside torch's allocator on a real GPU: its CUDA
                  context, and a trainer's communicators and library handles (RUNTIME_BYTES)

A phase's peak is the sum over roles, the sum of each role's kinds: every kind a role holds
in a phase is alive at once at its peak (a train call's last micro-batch holds the params,
the accumulated grads, the optimizer and its activations).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ppo import config as C
from ppo.config import PPOConfig
from ppo.gpu.sizing import compute_dtype_bytes
from ppo.gpu.placement import Placement, plan_placement
from roles.model_spec import ModelSpec
from roles.phase_memory import micro_batch_bytes
from runtime.units import format_bytes

GIB = 1 << 30
MIB = 1 << 20
# Device memory a process holds outside torch's allocator, as the CUDA out-of-memory report of
# the first 80 GB run counted it (H100, torch 2.11, CUDA 13, 2026-12-07): a megatron trainer
# once it has trained 1.65 GiB (its CUDA context, NCCL's communicators, cuBLAS handles), the
# built-in engine after releasing its memory 756 MiB, a process with only its context 518 MiB.
RUNTIME_BYTES = {"trainer": 1690 * MIB, "engine": 768 * MIB}
# The same report: the training actor's allocator held 1.14 GiB reserved but unallocated beside
# its 72.3 GiB (1.6%), the blocks its micro-batches freed, too small for the next allocation.
ALLOCATOR_SLACK = 0.02
KINDS = ("weights", "grads", "optimizer", "kv_cache", "activations", "sync_buffers", "slack", "cuda_context")
# what torch's allocator never reports as allocated (ppo.gpu.plan_check.cuda_peaks leaves them out)
OUTSIDE_ALLOCATOR = ("slack", "cuda_context")


@dataclass(frozen=True, kw_only=True)
class PhaseMemory:
    """What each role holds on one GPU in one phase: {role: {kind: bytes}}."""

    phase: str
    gpu: int
    held: dict[str, dict[str, int]]

    @property
    def peak(self) -> int:
        return sum(sum(kinds.values()) for kinds in self.held.values())

    def by_role(self) -> dict[str, int]:
        return {role: sum(kinds.values()) for role, kinds in self.held.items()}


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    capacity: int  # bytes of one GPU
    phases: tuple[PhaseMemory, ...]
    notes: tuple[str, ...] = field(default=())  # what the plan leaves out, said in the dry run

    def peak(self, phase: str, gpu: int) -> int:
        return next(p.peak for p in self.phases if p.phase == phase and p.gpu == gpu)

    def worst(self) -> PhaseMemory:
        return max(self.phases, key=lambda p: p.peak)

    @property
    def builds_in_turn(self) -> bool:
        """Whether the trainers build one after the other (megatron; they do not fit at once)."""
        return any(p.phase.startswith("build_") for p in self.phases)

    def fits(self) -> bool:
        return self.worst().peak <= self.capacity

    def to_dict(self) -> dict:
        """RUN_DIR/memory_plan.json: what a run planned, for bench.iteration to hold its peaks against."""
        return {"capacity": self.capacity, "notes": list(self.notes),
                "phases": [{"phase": p.phase, "gpu": p.gpu, "peak": p.peak, "held": p.held} for p in self.phases]}


def model_parameters(spec: ModelSpec, *, lm_head: bool, value_head: bool = False, tp: int = 1) -> int:
    """Parameters of one tensor-parallel rank of the whole model: the embedding (vocab padded to
    a multiple of tp), the layers, the final norm, an LM head unless tied (a policy), a value
    head (a critic: hidden -> 1 with a bias, replicated)."""
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    layer = h * (q + 2 * kv) + q * h + 3 * h * spec.intermediate_size
    if spec.qkv_bias:
        layer += q + 2 * kv
    layer //= tp
    layer += 2 * h + (2 * hd if spec.qk_norm else 0)  # norms are replicated over TP
    embedding = spec.padded_vocab(tp) * h // tp
    head = embedding if lm_head and not spec.tied_embeddings else 0
    return embedding + spec.num_layers * layer + h + head + (h + 1 if value_head else 0)


@dataclass(frozen=True)
class _Trainer:
    """One trainer rank's state, per GPU."""

    name: str
    gpus: tuple[int, ...]
    weights: int
    grads: int
    optimizer: int
    build_optimizer: int  # what the optimizer holds while it builds (megatron: main params)
    forward: int  # activations of the largest forward-only micro-batch
    train: int  # activations of the largest train micro-batch
    grads_at_rest: bool  # megatron's grad buffer exists between train calls; torch's grads do not
    grads_beside_activations: bool  # torch: only from a step's second micro-batch on


def _trainer(cfg: PPOConfig, spec: ModelSpec, name: str, gpus: list[int], *, critic: bool,
             prompt_len: int) -> _Trainer:
    t, par = cfg.training, cfg.parallelism
    megatron = t.train_backend == "megatron"
    w = compute_dtype_bytes(cfg)
    tp, pp = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) if megatron else (1, 1)
    params = model_parameters(spec, lm_head=not critic, value_head=critic, tp=tp) // pp
    dp = C.data_parallel_size(cfg) if megatron else 1
    width = prompt_len + (cfg.rollout.rollout_max_response_len or 0)
    rows_fwd = max(1, C.samples_per_rollout(cfg) // C.data_parallel_size(cfg))
    rows_train = max(1, C.global_batch_size(cfg) // C.data_parallel_size(cfg))
    recompute = t.recompute_granularity == "full"

    def micro_batch_rows(rows: int) -> int:
        if t.use_dynamic_batch_size and t.max_tokens_per_gpu:
            return min(rows, max(1, t.max_tokens_per_gpu // width))
        return min(rows, t.micro_batch_size)

    def activations(rows: int, training: bool) -> int:
        rows = micro_batch_rows(rows)
        tokens = rows * width
        logit_rows = rows * (cfg.rollout.rollout_max_response_len or 0)
        if megatron:  # float32 logits one chunk of rows at a time (roles.trainer.megatron.logprobs)
            from roles.trainer.megatron.config import MegatronTrainerConfig

            logit_rows = min(logit_rows, MegatronTrainerConfig.logits_chunk_tokens)
        return micro_batch_bytes(spec, num_tokens=tokens, num_logit_tokens=logit_rows,
                                 width=w, training=training, gradient_checkpointing=recompute,
                                 with_logits=not critic)

    if megatron:  # --optimizer-cpu-offload keeps a share of the optimizer in host memory for good
        on_gpu = 1 - cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else 1
        optimizer = int(params * 12 // dp * on_gpu)
        weights, grads, build = params * w, params * 4, int(params * 4 // dp * on_gpu)
    else:
        rope = 2 * (spec.head_dim // 2) * 4  # HF's rotary buffers inv_freq and original_inv_freq, float32
        weights, grads, optimizer, build = params * w + rope, params * w, params * 2 * w, 0
    return _Trainer(name, tuple(gpus), weights, grads, optimizer, build, activations(rows_fwd, False),
                    activations(rows_train, True), grads_at_rest=megatron,
                    grads_beside_activations=megatron or micro_batch_rows(rows_train) < rows_train)


@dataclass(frozen=True)
class _Engine:
    name: str
    gpus: tuple[int, ...]
    weights: int
    kv_cache: int


def _engine(cfg: PPOConfig, spec: ModelSpec, index: int, gpus: list[int], *, fake: bool, capacity: int) -> _Engine:
    w = compute_dtype_bytes(cfg)
    tp = len(gpus)
    weights = model_parameters(spec, lm_head=True, tp=tp) * w
    fraction = cfg.engine.sglang_mem_fraction_static
    if fraction and not fake:  # ppo.setup.role_configs.engine_config: a share of the real GPU
        kv = int(capacity * fraction) - weights
    else:  # the built-in engine's default budget: max_batch_size full-context rows
        rows = _engine_rows(cfg)
        kv = rows * spec.max_positions * spec.kv_elements_per_token * w // tp
    return _Engine(f"rollout-{index}", tuple(gpus), weights, max(kv, 0))


def _engine_rows(cfg: PPOConfig) -> int:
    """Sequences an engine runs at once: the rollout's samples (the built-in engine's max_batch_size),
    or sglang's --sglang-max-running-requests (ppo.setup.role_configs.engine_config)."""
    samples = C.samples_per_rollout(cfg)
    return samples if cfg.engine.rollout_backend != "sglang" else cfg.engine.sglang_max_running_requests or samples


def plan_memory(cfg: PPOConfig, spec: ModelSpec, *, capacity: int, prompt_len: int,
                placement: Placement | None = None) -> MemoryPlan:
    """The memory plan of a validated config on GPUs of `capacity` bytes; `prompt_len`: the
    longest prompt in tokens (the dry run's bound: --rollout-max-prompt-len or DEFAULT_PROMPT_LEN)."""
    plan = placement or plan_placement(cfg)
    fake = plan.fake_gpus
    trainers = [_trainer(cfg, spec, "actor", plan.actor_gpus, critic=False, prompt_len=prompt_len)]
    if plan.critic_gpus:
        trainers.append(_trainer(cfg, spec, "critic", plan.critic_gpus, critic=True, prompt_len=prompt_len))
    engines = [_engine(cfg, spec, i, gpus, fake=fake, capacity=capacity) for i, gpus in enumerate(plan.engines)]
    train_frees, rollout_frees = C.train_offload_tags(cfg), C.rollout_offload_tags(cfg)
    senders = _sending_gpus(cfg, plan)
    megatron = cfg.training.train_backend == "megatron"
    bucket = cfg.engine.update_weight_buffer_size

    def at_rest(tr: _Trainer) -> dict[str, int]:
        return {"weights": 0 if "params" in train_frees else tr.weights,
                "grads": tr.grads if tr.grads_at_rest and "grads" not in train_frees else 0,
                "optimizer": 0 if "optimizer" in train_frees else tr.optimizer}

    def engine_at_rest(e: _Engine) -> dict[str, int]:
        return {"weights": 0 if "weights" in rollout_frees else e.weights,
                "kv_cache": 0 if "kv_cache" in rollout_frees else e.kv_cache}

    def turn(tr: _Trainer, phase: str, g: int) -> dict[str, int]:
        """The trainer's state on GPU `g` while it computes `phase`."""
        if phase == "build":  # megatron: the module's own parameters live until DDP's buffer holds their copy
            return {"weights": 2 * tr.weights, "grads": tr.grads, "optimizer": tr.build_optimizer}
        if phase in ("log_probs", "values"):
            return {**at_rest(tr), "weights": tr.weights, "activations": tr.forward}
        if phase == "weight_sync" and g not in senders:
            return {**at_rest(tr), "weights": tr.weights}
        if phase == "weight_sync":
            buffers = bucket * min(2, -(-tr.weights // bucket))  # double-buffered buckets (roles.weight_sync)
            return {**at_rest(tr), "weights": tr.weights, "sync_buffers": buffers}
        # the peak of a train call: its last micro-batch, beside the grads of the ones before (a
        # torch trainer with one micro-batch a step has its grads only once its activations are freed)
        held = {"weights": tr.weights, "optimizer": tr.optimizer,
                **({"grads": tr.grads, "activations": tr.train} if tr.grads_beside_activations
                   else {"activations": max(tr.train, tr.grads)})}
        return held if fake else {**held, "slack": int(sum(held.values()) * ALLOCATOR_SLACK)}

    # (phase, whose turn: a trainer's name, "build" for all trainers at once, or "engines")
    sequence = [("rollout", "engines"), ("log_probs", "actor")]
    if plan.critic_gpus:
        sequence += [("values", "critic"), ("critic_train", "critic")]
    sequence += [("actor_train", "actor"), ("weight_sync", "actor")]
    gpus = sorted({g for t in trainers for g in t.gpus} | {g for e in engines for g in e.gpus})

    def phases_of(sequence: list[tuple[str, str]]) -> list[PhaseMemory]:
        return [_phase(phase, active, g) for phase, active in sequence for g in gpus]

    def _phase(phase: str, active: str, g: int) -> PhaseMemory:
        building = phase.startswith("build")
        held: dict[str, dict[str, int]] = {}
        names = [tr.name for tr in trainers]
        started = names if active not in names or not building else names[:names.index(active) + 1]
        for tr in trainers:
            if g in tr.gpus and tr.name in started:  # building in turn: the earlier ones offloaded everything
                held[tr.name] = (turn(tr, "build", g) if active in ("build", tr.name) else {}) if building \
                    else turn(tr, phase, g) if tr.name == active else at_rest(tr)
        for e in engines:  # they spawn once the trainers are built
            if g not in e.gpus or building:
                continue
            if active == "engines":
                held[e.name] = {"weights": e.weights, "kv_cache": e.kv_cache}
            elif phase == "weight_sync":  # the weights come back first, the KV cache after the sync
                held[e.name] = {**engine_at_rest(e), "weights": e.weights}
            else:
                held[e.name] = engine_at_rest(e)
        if not fake:  # every process on the GPU has its context, whatever it holds
            for role, kinds in held.items():
                kinds["cuda_context"] = RUNTIME_BYTES["trainer" if role in names else "engine"]
        return PhaseMemory(phase=phase, gpu=g, held={r: {k: v for k, v in kinds.items() if v}
                                                     for r, kinds in held.items()})

    # Start-up: megatron trainers build on the GPU (and offload at the end of their build); they
    # build at once where that fits, else one after the other (ppo.setup.job follows `builds_in_turn`)
    build = []
    if megatron:
        build = phases_of([("build", "build")])
        if max(p.peak for p in build) > capacity and len(trainers) > 1:
            build = phases_of([(f"build_{t.name}", t.name) for t in trainers])
    notes = []
    rows = _engine_rows(cfg)
    sequence_bytes = (prompt_len + (cfg.rollout.rollout_max_response_len or 0)) * spec.kv_elements_per_token \
        * compute_dtype_bytes(cfg)
    for e in engines:
        held = e.kv_cache * len(e.gpus) // sequence_bytes
        if held < rows:
            notes.append(f"{e.name}'s KV cache holds {held} of the {rows} sequences it may run at once "
                         "(a larger --sglang-mem-fraction-static holds more)")
    if cfg.reward.reward_model_path is not None:
        notes.append("the reward model's turn on the engines' GPUs is not in this plan")
    return MemoryPlan(capacity=capacity, phases=tuple(build + phases_of(sequence)), notes=tuple(notes))


def _sending_gpus(cfg: PPOConfig, plan: Placement) -> set[int]:
    """The actor's GPUs whose ranks gather and send the weights in a sync: data-parallel and
    context-parallel rank 0 (roles.trainer.megatron.core `gathers_weights`; megatron's rank
    order tp, cp, dp, pp), every TP shard and pipeline stage of it; the torch backend's rank 0."""
    if cfg.training.train_backend != "megatron":
        return {plan.actor_gpus[0]}
    par = plan.trainer_parallel
    tp, cp, dp = par["tp"], par["cp"], par["dp"]
    return {g for rank, g in enumerate(plan.actor_gpus) if (rank // tp) % cp == 0 and (rank // (tp * cp)) % dp == 0}
