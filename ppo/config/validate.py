"""`validate(cfg)`: every problem of a configuration, each naming the flag, the field, the value
and what is allowed, so one run of the CLI reports them all.

Field-local rules (types, choices, ranges) come from the metadata in `schema`; the rules
below them relate fields to each other. The PPO rules follow miles (critic on the actor's
GPUs with its parallelism, colocation offloads the trainers, engines tile the GPUs), except
where Tandem's iteration order lifts one: ref log-probs exist before the critic computes its
targets, so reward-level KL (--kl-coef) is allowed with --advantage-estimator ppo.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ppo.config import derived as d
from ppo.config.cluster import cluster_problems
from ppo.config.layout import gpu_layout
from ppo.config.schema import (
    FIELDS,
    GENERATED_DATASETS,
    GENERATED_EVAL_DATASETS,
    GENERATED_MODELS,
    GENERATED_PREFIX,
    REMOTE_RM,
    RM_TYPES,
    ConfigError,
    FieldSpec,
    PPOConfig,
)


def validate(cfg: PPOConfig, *, rm_types: Sequence[str] = RM_TYPES) -> list[str]:
    """All problems of `cfg` (empty when it is valid). `rm_types` are the known --rm-type names."""
    problems, broken = [], set()
    for spec in FIELDS.values():
        if problem := _check_field(spec, _value(cfg, spec)):
            problems.append(problem)
            broken.add(spec.name)
    if any(not _type_ok(FIELDS[n].kind, _value(cfg, FIELDS[n]), FIELDS[n].item) for n in broken):
        return problems  # the rules below would compare a string with a number
    problems += (_required(cfg, rm_types) + _sampling(cfg) + _algorithm(cfg) + _optimizer(cfg)
                 + _backends(cfg) + _outputs(cfg) + _evaluation(cfg, rm_types) + _reward_model(cfg)
                 + _asynchronous(cfg) + _generate(cfg))
    if not broken & _DIVISORS:  # these rules divide by those fields
        placement = _placement(cfg)
        problems += placement + _batches(cfg)
        if not placement:  # the cluster rules count the nodes that the placement uses
            problems += cluster_problems(cfg, gpu_layout(cfg).num_nodes)
    return problems


_DIVISORS = {
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
    "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine",
    "rollout_batch_size", "n_samples_per_prompt", "num_steps_per_rollout",
    "global_batch_size", "micro_batch_size",
}


def ensure_valid(cfg: PPOConfig, *, rm_types: Sequence[str] = RM_TYPES) -> PPOConfig:
    """`cfg` itself, or ConfigError listing every problem."""
    problems = validate(cfg, rm_types=rm_types)
    if problems:
        raise ConfigError(problems)
    return cfg


def describe(spec: FieldSpec, value: Any) -> str:
    """How a problem names a setting: the flag as typed, then the field it lands in."""
    if spec.kind is bool and isinstance(value, bool):
        return f"{spec.flag if value else '--no-' + spec.flag[2:]} ({spec.path})"
    if isinstance(value, tuple):
        value = " ".join(map(str, value))
    return f"{spec.flag} {value!r} ({spec.path})"


def allowed(spec: FieldSpec) -> str:
    """The allowed values of a field in words, e.g. 'in (0, 1)' or 'one of: k1, k2'."""
    m = spec.meta
    if m.get("choices"):
        return "one of: " + ", ".join(m["choices"])
    low = f"({m['gt']}" if "gt" in m else f"[{m['ge']}" if "ge" in m else None
    high = f"{m['lt']})" if "lt" in m else f"{m['le']}]" if "le" in m else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1:]}"
    if high:
        return f"{'<' if high[-1] == ')' else '<='} {high[:-1]}"
    return ""


def _value(cfg: PPOConfig, spec: FieldSpec) -> Any:
    return getattr(getattr(cfg, spec.group), spec.name)


def _type_ok(kind: type, value: Any, item: type = int) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is tuple:
        return isinstance(value, tuple) and all(_type_ok(item, v) for v in value)
    return isinstance(value, kind)


def _in_range(spec: FieldSpec, x: Any) -> bool:
    m = spec.meta
    if m.get("choices") and x not in m["choices"]:
        return False
    return not (("ge" in m and not x >= m["ge"]) or ("gt" in m and not x > m["gt"])
                or ("le" in m and not x <= m["le"]) or ("lt" in m and not x < m["lt"]))


def _check_field(spec: FieldSpec, value: Any) -> str | None:
    if value is None:
        return None if spec.optional else f"{spec.flag} (field {spec.path}) must not be None"
    if not _type_ok(spec.kind, value, spec.item):
        kind = f"a tuple of {spec.item.__name__}s" if spec.kind is tuple else spec.kind.__name__
        return f"{describe(spec, value)}: expected {kind}, got {type(value).__name__}"
    items = value if spec.kind is tuple else (value,)
    if not all(_in_range(spec, x) for x in items):
        return f"{describe(spec, value)}: must be {allowed(spec)}"
    return None


def _bad(name: str, value: Any, reason: str) -> str:
    return f"{describe(FIELDS[name], value)}: {reason}"


def _set_but(name: str, value: Any, rest: str) -> str:
    """slime's fix-it phrasing: '--x 1 (group.x) is set but --y is not enabled. Please add --y'."""
    return f"{describe(FIELDS[name], value)} is set but {rest}"


def _generated(name: str, value: str, known: tuple[str, ...]) -> list[str]:
    if not value.startswith(GENERATED_PREFIX) or value[len(GENERATED_PREFIX):] in known:
        return []
    options = ", ".join(GENERATED_PREFIX + k for k in known)
    return [_bad(name, value, f"must be a path or one of: {options}")]


def _required(cfg: PPOConfig, rm_types: Sequence[str]) -> list[str]:
    out = []
    for name, hint in (("hf_checkpoint", "PATH (or generated:tiny-qwen3)"),
                       ("prompt_data", "PATH (or generated:arithmetic)"),
                       ("rollout_batch_size", "N"), ("num_rollout", "N")):
        if _value(cfg, FIELDS[name]) is None:
            out.append(f"{FIELDS[name].flag} ({FIELDS[name].path}) is required. "
                       f"Please add {FIELDS[name].flag} {hint}")
    if cfg.checkpoint.hf_checkpoint is not None:
        out += _generated("hf_checkpoint", cfg.checkpoint.hf_checkpoint, GENERATED_MODELS)
    if cfg.rollout.prompt_data is not None:
        out += _generated("prompt_data", cfg.rollout.prompt_data, GENERATED_DATASETS)
    r = cfg.reward
    if r.custom_rm_path is None:  # a custom reward function replaces --rm-type
        if r.rm_type is None and r.reward_model_path is None:
            out.append("--rm-type (reward.rm_type) is not set. Please add --rm-type "
                       f"(one of: {', '.join(rm_types)}), --custom-rm-path or --reward-model-path")
        elif r.rm_type is not None and r.rm_type not in (*rm_types, REMOTE_RM):
            out.append(_bad("rm_type", r.rm_type, f"must be one of: {', '.join((*rm_types, REMOTE_RM))}"))
    remote = r.custom_rm_path is None and r.rm_type == REMOTE_RM
    if remote and r.rm_url is None:
        out.append("--rm-type remote_rm needs the service's URL. Please add --rm-url http://HOST:PORT/PATH")
    elif r.rm_url is not None and not remote:
        out.append(_set_but("rm_url", r.rm_url, "--rm-type is not remote_rm"
                            f"{' (--custom-rm-path replaces it)' if r.custom_rm_path else ''}. "
                            "Please add --rm-type remote_rm"))
    elif remote and not r.rm_url.startswith("http://"):
        out.append(_bad("rm_url", r.rm_url, "must be an http://HOST[:PORT]/PATH URL"))
    return out


def _sampling(cfg: PPOConfig) -> list[str]:
    top_k = cfg.rollout.rollout_top_k
    if top_k == -1 or top_k >= 1:
        return []
    return [_bad("rollout_top_k", top_k, "must be -1 (off) or >= 1")]


def _algorithm(cfg: PPOConfig) -> list[str]:
    p, out = cfg.ppo, []
    if p.kl_loss_coef != 0 and not p.use_kl_loss:
        out.append(_set_but("kl_loss_coef", p.kl_loss_coef,
                            "--use-kl-loss is not enabled. Please add --use-kl-loss"))
    if p.kl_coef != 0 and p.use_kl_loss and p.kl_loss_coef != 0:
        out.append(_bad("kl_coef", p.kl_coef,
                        f"--kl-coef and --kl-loss-coef {p.kl_loss_coef} are both set; the KL "
                        "penalty would count twice. Please set one of them to 0"))
    if p.advantage_estimator.startswith("reinforce_plus_plus") and not p.normalize_advantages:
        out.append(_bad("advantage_estimator", p.advantage_estimator,
                        "needs advantage normalization. Please add --normalize-advantages"))
    if (p.advantage_estimator in ("grpo", "gspo", "reinforce_plus_plus_baseline")
            and cfg.rollout.n_samples_per_prompt < 2):
        out.append(_bad("n_samples_per_prompt", cfg.rollout.n_samples_per_prompt,
                        f"--advantage-estimator {p.advantage_estimator} takes its baseline from "
                        "the other samples of a prompt. Please set --n-samples-per-prompt >= 2"))
    warmup = d.num_critic_only_steps(cfg)
    if warmup > 0:
        if not d.uses_critic(cfg):
            out.append(_set_but("num_critic_only_steps", p.num_critic_only_steps,
                                f"--advantage-estimator is {p.advantage_estimator}, which has "
                                "no critic. Please add --advantage-estimator ppo or remove "
                                "--num-critic-only-steps"))
        elif cfg.rollout.num_rollout is not None and warmup >= cfg.rollout.num_rollout:
            unset = "" if p.num_critic_only_steps is not None else " (unset: 1 with a critic)"
            out.append(_bad("num_critic_only_steps", warmup,
                            f"must be < --num-rollout {cfg.rollout.num_rollout}{unset}, "
                            "or the actor never trains"))
    return out + _mismatch(cfg) + _dynamic_sampling(cfg) + _partial_rollout(cfg)


def _mismatch(cfg: PPOConfig) -> list[str]:
    """miles' rules for TIS and the rollout log-probs, less one: --get-mismatch-metrics needs
    no --custom-tis-function-path here (Tandem computes the metrics itself)."""
    p, out = cfg.ppo, []
    if p.use_tis and p.use_rollout_logprobs:
        out.append(_bad("use_rollout_logprobs", True, "--use-tis weights by p_train / p_rollout, which is 1 "
                        "when the ratio is already taken against the engine's log-probs. Please remove "
                        "one of --use-tis and --use-rollout-logprobs"))
    if d.use_tis(cfg) and not p.tis_clip_low < p.tis_clip:
        out.append(_bad("tis_clip_low", p.tis_clip_low, f"must be < --tis-clip {p.tis_clip}"))
    if p.custom_tis_function_path is not None and not d.use_tis(cfg):
        out.append(_set_but("custom_tis_function_path", p.custom_tis_function_path,
                            "--use-tis is not enabled. Please add --use-tis"))
    return out


def _asynchronous(cfg: PPOConfig) -> list[str]:
    """--train-async generates while the trainers train, so the engines keep their memory: on
    GPUs of their own, or (--colocate) side by side with the trainers, in a memory budget."""
    r, out = cfg.rollout, []
    if not r.train_async:
        return out
    if d.side_by_side(cfg):
        out += _side_by_side(cfg)
    if d.offload_rollout(cfg):
        out.append(_bad("offload_rollout", True, "with --train-async the engines generate while the trainers "
                        "train and keep their memory. Please remove --offload-rollout"))
    if cfg.reward.reward_model_path is not None and not cfg.reward.reward_model_num_gpus:
        out.append(_set_but("train_async", True, "so is --reward-model-path on the engines' GPUs, which the engines "
                            "keep while they generate ahead. Please add --reward-model-num-gpus N (GPUs of its own)"))
    return out


def _side_by_side(cfg: PPOConfig) -> list[str]:
    """Side by side, the engine's memory budget is --sglang-mem-fraction-static of each GPU and
    the trainers' the rest; they take turns only with their optimizer state."""
    p, out = cfg.placement, []
    if cfg.engine.sglang_mem_fraction_static is None:
        out.append(_set_but("train_async", True, "so is --colocate (side by side), where the engine's memory "
                            "budget is its fraction of the GPU. Please add --sglang-mem-fraction-static F "
                            "(e.g. 0.4: weights and KV cache; the trainers get the rest)"))
    if d.offload_train(cfg) and p.offload_train_level != "optimizer":
        out.append(_bad("offload_train_level", p.offload_train_level, "side by side (--train-async --colocate) "
                        "the trainers keep their weights beside the engine and take turns with their optimizer "
                        "state. Please add --offload-train-level optimizer"))
    return out


def _dynamic_sampling(cfg: PPOConfig) -> list[str]:
    r, out = cfg.rollout, []
    if r.over_sampling_batch_size is None:
        return out
    if r.dynamic_sampling_filter_path is None and not r.partial_rollout:
        out.append(_set_but("over_sampling_batch_size", r.over_sampling_batch_size,
                            "--dynamic-sampling-filter-path (rollout.dynamic_sampling_filter_path) is not; "
                            "without a filter the extra prompts would be sampled and thrown away. Please add "
                            "--dynamic-sampling-filter-path ppo.generate.dynamic_sampling.check_reward_nonzero_std "
                            "(or --partial-rollout, which continues them in the next rollout)"))
    if r.rollout_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        out.append(_bad("over_sampling_batch_size", r.over_sampling_batch_size,
                        f"must be >= --rollout-batch-size {r.rollout_batch_size}"))
    return out


def _partial_rollout(cfg: PPOConfig) -> list[str]:
    """What partial rollouts (ppo.generate.partial) work with today; the rest is refused by name."""
    r, out = cfg.rollout, []
    if r.mask_offpolicy_in_partial_rollout and not r.partial_rollout:
        out.append(_set_but("mask_offpolicy_in_partial_rollout", True, "--partial-rollout is not. Please add "
                            "--partial-rollout"))
    if not r.partial_rollout:
        return out
    # a generate function's (an agent's) state lives where the buffer cannot see it; the built-in
    # tool loop's trajectories are continued (ppo.generate.partial_tools)
    refused = [("custom_generate_function_path", cfg.generate.custom_generate_function_path,
                "--custom-generate-function-path"),
               ("custom_agent_function_path", cfg.generate.custom_agent_function_path, "--custom-agent-function-path")]
    for field, value, flag in refused:
        if value is not None:
            out.append(_set_but(field, value, f"so is --partial-rollout, which cannot continue the state of {flag} "
                                "(docs/partial_rollouts.md). Please remove one"))
    if cfg.generate.generate_tool_specs_path is not None and r.dynamic_sampling_filter_path is not None:
        out.append(_set_but("dynamic_sampling_filter_path", r.dynamic_sampling_filter_path, "so are --partial-rollout "
                            "and --generate-tool-specs-path, whose partial rollout has no sampling rounds yet "
                            "(docs/partial_rollouts.md). Please remove one"))
    return out


def _generate(cfg: PPOConfig) -> list[str]:
    g, out = cfg.generate, []
    if g.generate_execute_tool_function_path is not None and g.generate_tool_specs_path is None:
        out.append(_set_but("generate_execute_tool_function_path", g.generate_execute_tool_function_path,
                            "--generate-tool-specs-path is not: the model must be told which tools it has. "
                            "Please add --generate-tool-specs-path"))
    if (g.generate_tool_specs_path is not None and g.generate_execute_tool_function_path is None
            and g.custom_generate_function_path is None):
        out.append(_set_but("generate_tool_specs_path", g.generate_tool_specs_path,
                            "--generate-execute-tool-function-path is not: the tool loop has nothing to run the "
                            "calls with. Please add --generate-execute-tool-function-path"))
    if g.custom_agent_function_path is not None and g.custom_generate_function_path is not None:
        out.append(_set_but("custom_agent_function_path", g.custom_agent_function_path,
                            "so is --custom-generate-function-path: an agent session is the trajectory's "
                            "generate function. Please drop one of them"))
    return out


def _optimizer(cfg: PPOConfig) -> list[str]:
    o, out = cfg.optimizer, []
    if 0 < o.lr < o.min_lr:  # a non-positive --lr is already reported
        out.append(_bad("min_lr", o.min_lr, f"must be <= --lr {o.lr}"))
    if o.critic_lr is not None and d.uses_critic(cfg) and 0 < o.critic_lr < o.min_lr:
        out.append(_bad("min_lr", o.min_lr, f"must be <= --critic-lr {o.critic_lr}"))
    if o.optimizer_cpu_offload and cfg.training.train_backend != "megatron":
        out.append(_bad("optimizer_cpu_offload", True, "needs --train-backend megatron (megatron-core's CPU optimizer)"))
    return out


def _backends(cfg: PPOConfig) -> list[str]:
    t, out = cfg.training, []
    if t.use_dynamic_batch_size and t.max_tokens_per_gpu is None:
        out.append("--use-dynamic-batch-size is set but --max-tokens-per-gpu "
                   "(training.max_tokens_per_gpu) is not. Please add --max-tokens-per-gpu N")
    if t.train_backend == "torch":
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size"):
            if (size := getattr(cfg.parallelism, name)) > 1:
                out.append(_bad(name, size, "needs --train-backend megatron "
                                "(the torch backend is data parallel only)"))
    out += _recompute(t)
    if t.train_backend == "torch" and t.transformer_impl != "local":
        out.append(_bad("transformer_impl", t.transformer_impl, "needs --train-backend megatron"))
    if cfg.engine.rollout_backend == "torch" and cfg.engine.rollout_num_gpus_per_engine != 1:
        out.append(_bad("rollout_num_gpus_per_engine", cfg.engine.rollout_num_gpus_per_engine,
                        "must be 1 with --rollout-backend torch (a torch engine is one device)"))
    if cfg.engine.rollout_backend == "sglang" and cfg.engine.check_weight_update_equal:
        out.append(_set_but("check_weight_update_equal", True, "--rollout-backend is 'sglang', "
                            "which has no exact read-back of its weights. Please add "
                            "--rollout-backend torch or --no-check-weight-update-equal"))
    if cfg.engine.sglang_dp_size != 1:  # roles/rollout/sglang_backend.py REFUSED_OPTIONS says why
        out.append(_bad("sglang_dp_size", cfg.engine.sglang_dp_size,
                        "must be 1: sglang refuses update_weights_from_tensor with more than one "
                        "data-parallel replica (it asserts mid-sync). Please add --sglang-dp-size 1 "
                        "and more engines (--rollout-num-gpus) instead"))
    if cfg.placement.fake_gpus:
        for name, value in (("train_backend", t.train_backend),
                            ("rollout_backend", cfg.engine.rollout_backend)):
            if value != "torch":
                out.append(_set_but("fake_gpus", True, f"--{name.replace('_', '-')} is "
                                    f"{value!r}, which needs real GPUs. Please add "
                                    f"--{name.replace('_', '-')} torch"))
    return out


def _recompute(t) -> list[str]:
    """miles' recompute flags as megatron's TransformerConfig accepts them; the torch backend
    recomputes whole layers only (HF gradient checkpointing of every layer)."""
    g, m, n, out = t.recompute_granularity, t.recompute_method, t.recompute_num_layers, []
    if g is None:
        for name, value in (("recompute_method", m), ("recompute_num_layers", n)):
            if value is not None:
                out.append(_set_but(name, value, "--recompute-granularity (training.recompute_granularity) "
                                    "is not. Please add --recompute-granularity full"))
        return out
    if g == "full":
        if m is None:
            out.append(_bad("recompute_granularity", g, "needs --recompute-method (uniform or block). "
                            "Please add --recompute-method uniform"))
        if n is None:
            out.append(_bad("recompute_granularity", g, "needs --recompute-num-layers. "
                            "Please add --recompute-num-layers 1"))
    else:
        for name, value in (("recompute_method", m), ("recompute_num_layers", n)):
            if value is not None:
                out.append(_set_but(name, value, f"--recompute-granularity is {g!r}, which recomputes core "
                                    f"attention in every layer. Please remove --{name.replace('_', '-')}"))
    if t.train_backend == "torch" and (g, m, n) != ("full", "uniform", 1) and not out:
        name, value = next((k, v) for k, v, want in (("recompute_granularity", g, "full"),
                           ("recompute_method", m, "uniform"), ("recompute_num_layers", n, 1)) if v != want)
        out.append(_bad(name, value, "the torch backend recomputes every whole layer only "
                        "(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1); "
                        "others need --train-backend megatron"))
    return out


def _placement(cfg: PPOConfig) -> list[str]:
    p, e, out = cfg.placement, cfg.engine, []
    actor_gpus = d.actor_num_gpus(cfg)
    if d.actor_gpus_per_node(cfg) > p.num_gpus_per_node:
        out.append(_bad("actor_num_gpus_per_node", p.actor_num_gpus_per_node,
                        f"must be <= --num-gpus-per-node {p.num_gpus_per_node}"))
    if actor_gpus % d.model_parallel_size(cfg):
        out.append(f"--actor-num-nodes {p.actor_num_nodes} x --actor-num-gpus-per-node "
                   f"{d.actor_gpus_per_node(cfg)} = {actor_gpus} actor GPUs (shared by the critic) "
                   f"must be divisible by TP x PP x CP = {d.model_parallel_size(cfg)} (--tensor-model-parallel-size "
                   f"{cfg.parallelism.tensor_model_parallel_size} x --pipeline-model-parallel-size "
                   f"{cfg.parallelism.pipeline_model_parallel_size} x --context-parallel-size "
                   f"{cfg.parallelism.context_parallel_size}): each trainer is one "
                   "rank per GPU in a TP x PP x CP x DP grid. Please set --actor-num-gpus-per-node to a "
                   "multiple of it, or lower --tensor-model-parallel-size, --pipeline-model-parallel-size "
                   "or --context-parallel-size")
    # Colocated with --no-offload-train / --no-offload-rollout is allowed: a role that keeps its
    # memory leaves it beside the next lease holder (a residual of the lease table), which
    # fits when the GPU holds both (one-GPU plans; the fake-GPU ledger checks the sum).
    if p.colocate:
        if p.rollout_num_gpus is not None and p.rollout_num_gpus != actor_gpus:
            out.append(_bad("rollout_num_gpus", p.rollout_num_gpus,
                            f"with --colocate the engines run on the actor's {actor_gpus} GPUs. "
                            f"Please remove --rollout-num-gpus or set it to {actor_gpus}"))
        if d.actor_gpus_per_node(cfg) % e.rollout_num_gpus_per_engine:
            out.append(_bad("rollout_num_gpus_per_engine", e.rollout_num_gpus_per_engine,
                            "with --colocate it must divide --actor-num-gpus-per-node "
                            f"{d.actor_gpus_per_node(cfg)} so engines do not straddle nodes"))
    elif p.rollout_num_gpus is None:
        out.append("--rollout-num-gpus (placement.rollout_num_gpus) is not set. Please add "
                   "--rollout-num-gpus N (or --colocate to share the actor's GPUs)")
    for role, level, on in (("train", p.offload_train_level, d.offload_train(cfg)),
                            ("rollout", p.offload_rollout_level, d.offload_rollout(cfg))):
        if level != "all" and not on:
            out.append(_set_but(f"offload_{role}_level", level, f"--offload-{role} is off. Please remove "
                                f"--offload-{role}-level or add --offload-{role}"))
    rollout_gpus = d.rollout_num_gpus(cfg)
    if rollout_gpus is not None and rollout_gpus % e.rollout_num_gpus_per_engine:
        out.append(_bad("rollout_num_gpus_per_engine", e.rollout_num_gpus_per_engine,
                        f"must divide the {rollout_gpus} rollout GPUs so engines tile them"))
    if e.rollout_num_gpus_per_engine > p.num_gpus_per_node:
        out.append(_bad("rollout_num_gpus_per_engine", e.rollout_num_gpus_per_engine,
                        f"must be <= --num-gpus-per-node {p.num_gpus_per_node} "
                        "(an engine stays on one node)"))
    return out


def _batches(cfg: PPOConfig) -> list[str]:
    r, t, out = cfg.rollout, cfg.training, []
    if r.rollout_batch_size is None:
        return out  # reported as required
    samples = d.samples_per_rollout(cfg)
    per_rollout = (f"--rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt "
                   f"{r.n_samples_per_prompt} = {samples} samples")
    steps = cfg.ppo.num_steps_per_rollout
    if steps is not None:
        if samples % steps:
            out.append(_bad("num_steps_per_rollout", steps, f"must divide the {per_rollout}"))
        elif t.global_batch_size is not None and t.global_batch_size != samples // steps:
            out.append(_bad("global_batch_size", t.global_batch_size,
                            f"disagrees with {per_rollout} / --num-steps-per-rollout {steps} = "
                            f"{samples // steps}. Please set only one of the two"))
        if out:
            return out
    gbs = d.global_batch_size(cfg)
    if samples % gbs:
        out.append(f"{per_rollout} must be divisible by the global batch size {gbs} "
                   "(--global-batch-size, training.global_batch_size)")
    if d.actor_num_gpus(cfg) % d.model_parallel_size(cfg):
        return out  # no data-parallel size to check against; reported by _placement
    dp = d.data_parallel_size(cfg)
    if gbs % dp:
        out.append(f"the global batch size {gbs} (--global-batch-size, "
                   f"training.global_batch_size) must be divisible by the {dp} data-parallel ranks")
    elif not t.use_dynamic_batch_size and gbs % (dp * t.micro_batch_size):
        out.append(_bad("micro_batch_size", t.micro_batch_size,
                        f"the global batch size {gbs} must be divisible by {dp} data-parallel "
                        f"ranks x --micro-batch-size {t.micro_batch_size}"))
    return out


def _outputs(cfg: PPOConfig) -> list[str]:
    out = []
    c = cfg.checkpoint
    if c.save_interval is not None and c.save is None:
        out.append("--save-interval is set but --save (checkpoint.save) is not. "
                   "Please add --save PATH")
    if c.save_keep_last is not None and c.save is None:
        out.append("--save-keep-last is set but --save (checkpoint.save) is not. Please add --save PATH")
    if isinstance(c.max_trainer_restarts, int) and c.max_trainer_restarts > 0 and c.save is None:
        out.append(f"--max-trainer-restarts {c.max_trainer_restarts} is set but --save (checkpoint.save) is not: "
                   "a trainer comes back from the newest checkpoint. Please add --save PATH, or remove "
                   "--max-trainer-restarts")
    if c.save_on_signal and c.save is None:
        out.append("--save-on-signal is set but --save (checkpoint.save) is not: there is nowhere to save. "
                   "Please add --save PATH")
    # One folder for both trainers would have each overwrite (or load) the other's weights.
    for flag, actor_dir, critic_dir in (("save", c.save, d.critic_save(cfg)), ("load", c.load, d.critic_load(cfg))):
        if (d.uses_critic(cfg) and actor_dir is not None and critic_dir is not None
                and os.path.normpath(actor_dir) == os.path.normpath(critic_dir)):
            out.append(f"--critic-{flag} (checkpoint.critic_{flag}) is {critic_dir!r}, the actor's --{flag} folder; "
                       f"the critic's checkpoints need a folder of their own. Please remove --critic-{flag} "
                       f"(it defaults to --{flag} + '_critic') or choose another folder")
    if cfg.logging.use_wandb and cfg.logging.wandb_project is None:
        out.append("--use-wandb is set but --wandb-project (logging.wandb_project) is not. "
                   "Please add --wandb-project NAME")
    if cfg.logging.quiet and cfg.logging.log_format != "auto":
        out.append(f"--quiet is set and so is --log-format {cfg.logging.log_format} (logging.log_format); "
                   "quiet prints nothing but errors. Please remove one of them")
    return out


def _reward_model(cfg: PPOConfig) -> list[str]:
    """A reward model scores after generation, on the GPUs, and only the training rollouts."""
    r, out = cfg.reward, []
    if r.reward_model_path is None:
        if r.reward_model_num_gpus:
            out.append(_set_but("reward_model_num_gpus", r.reward_model_num_gpus,
                                "--reward-model-path is not. Please add --reward-model-path DIR"))
        return out
    if cfg.rollout.dynamic_sampling_filter_path is not None:
        out.append(_set_but("dynamic_sampling_filter_path", cfg.rollout.dynamic_sampling_filter_path,
                            "so is --reward-model-path: the filter runs while the engines generate, before the "
                            "reward model scores. Please remove one"))
    if r.rm_type is None and r.custom_rm_path is None and cfg.evaluation.eval_prompt_data is not None:
        out.append(_set_but("eval_prompt_data", cfg.evaluation.eval_prompt_data,
                            "--rm-type is not: eval sets are graded by rules, not by the reward model. Please add "
                            "--rm-type RULE (with --rule-reward-coef 0 to train on the reward model alone)"))
    return out


def _evaluation(cfg: PPOConfig, rm_types: Sequence[str]) -> list[str]:
    """miles' eval rules: NAME PATH pairs, and an interval only with sets to evaluate."""
    e, out = cfg.evaluation, []
    data = e.eval_prompt_data
    if data is not None:
        names = data[0::2]
        if len(data) % 2:
            out.append(_bad("eval_prompt_data", data, "must be NAME PATH pairs (an even number of "
                            "words), e.g. --eval-prompt-data aime /data/aime.jsonl"))
        elif dup := sorted({n for n in names if names.count(n) > 1}):
            out.append(_bad("eval_prompt_data", data, f"names a set twice ({', '.join(dup)}); "
                            "each set needs a name of its own (its metrics are eval/NAME...)"))
        for path in data[1::2]:
            out += _generated("eval_prompt_data", path, GENERATED_EVAL_DATASETS)
        if e.eval_interval is None:
            out.append(_set_but("eval_prompt_data", data, "--eval-interval (evaluation.eval_interval) is "
                                "not, so no eval would run. Please add --eval-interval N"))
    elif e.eval_interval is not None:
        out.append(_set_but("eval_interval", e.eval_interval, "--eval-prompt-data (evaluation.eval_prompt_data) "
                            "is not. Please add --eval-prompt-data NAME PATH"))
    if e.eval_rm_type is not None:
        num_sets = len(data) // 2 if data else 0
        if len(e.eval_rm_type) not in (1, num_sets):
            out.append(_bad("eval_rm_type", e.eval_rm_type, f"must name one rule for all eval sets or one "
                            f"per set ({num_sets} in --eval-prompt-data)"))
        if cfg.reward.custom_rm_path is None:
            out += [_bad("eval_rm_type", e.eval_rm_type, f"{t!r} must be one of: {', '.join(rm_types)}")
                    for t in e.eval_rm_type if t not in rm_types]
    if e.eval_top_k is not None and not (e.eval_top_k == -1 or e.eval_top_k >= 1):
        out.append(_bad("eval_top_k", e.eval_top_k, "must be -1 (off) or >= 1"))
    return out

