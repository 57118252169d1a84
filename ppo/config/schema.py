"""The typed PPO configuration: one frozen dataclass per group, nested under `PPOConfig`.

Field names are unique across groups and spelled as in miles, so the command line stays flat
(`--rollout-batch-size` sets `rollout.rollout_batch_size`). The dataclass defaults are the
only defaults; a field's metadata carries its allowed range and help text, which the
validator and the CLI both read. Settings that default to None either fall back to another
field (resolved in `ppo.config.derived`) or are required, which `validate` reports.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

ADVANTAGE_ESTIMATORS = ("ppo", "grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_LOSS_TYPES = ("k1", "k2", "k3", "low_var_kl")
# How per-token losses become one number (algorithms.aggregate): miles' default
# sum-of-sample-mean (each sample's token mean, summed, over the global batch size), or
# verl's token-mean, seq-mean-token-mean and seq-mean-token-sum.
LOSS_AGG_MODES = ("sum-of-sample-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
TRAIN_BACKENDS = ("torch", "megatron")
ROLLOUT_BACKENDS = ("torch", "sglang")
# Activation recompute, as megatron's TransformerConfig takes it (miles' flags).
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
# megatron's layer implementation (miles' and Megatron-LM's --transformer-impl)
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# What an offloading trainer / engine frees when it hands its GPUs over (ppo.config.derived).
OFFLOAD_TRAIN_LEVELS = ("all", "optimizer")
OFFLOAD_ROLLOUT_LEVELS = ("all", "kv_cache")
# How MPS schedules a side-by-side trainer's work against the engine's: runtime.mps.PRIORITIES' keys
MPS_PRIORITIES = ("normal", "below_normal")
# Reward functions known when no registry is passed to `validate`; the reward role owns the
# implementations and passes its own registry keys.
RM_TYPES = ("deepscaler", "dapo", "math", "tiny_exact", "tiny_digits")
REMOTE_RM = "remote_rm"  # miles' --rm-type of a reward service at --rm-url (roles.reward.remote)

# `generated:NAME` in --hf-checkpoint / --prompt-data asks the launcher to build a tiny
# random-init model / a synthetic task instead of reading a path (no hub on CPU machines).
GENERATED_PREFIX = "generated:"
GENERATED_MODELS = ("tiny-qwen3", "tiny-qwen3-tools")  # -tools: knows the calculator call (ppo.generate.tiny_tools)
GENERATED_DATASETS = ("arithmetic", "column_sums", "column_sums_small", "tool_sums")
# Sets for --eval-prompt-data (ppo.prompts.tasks.EVAL_TASKS): the sums the training task leaves out, and the rest.
GENERATED_EVAL_DATASETS = ("arithmetic_heldout", "arithmetic_seen", "column_sums_heldout", "column_sums_seen",
                           "column_sums_small_heldout", "column_sums_small_seen", "tool_sums_eval")
# --generate-tool-call-parser: sglang's parser names for `<tool_call>{json}</tool_call>` (Qwen2.5/Qwen3, Hermes)
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes")

# What the run prints (ppo.observe.console): "auto" is a progress bar on a terminal and one plain line
# per rollout otherwise (a file, a pipe, nohup, Slurm); "json" is one JSON object per line.
LOG_FORMATS = ("auto", "rich", "plain", "json")


def knob(default: Any, help: str = "", *, choices: tuple[str, ...] | None = None,
         ge: float | None = None, gt: float | None = None,
         le: float | None = None, lt: float | None = None) -> Any:
    """A config field: its default plus the allowed range that `validate` checks."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return field(default=default, metadata={"help": help, "choices": choices, **bounds})


class ConfigError(ValueError):
    """Every problem found in a configuration, reported at once; `.problems` holds the list."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem"
                         f"{'' if len(self.problems) == 1 else 's'}):\n{lines}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    hf_checkpoint: str | None = knob(
        None, "HF checkpoint dir (weights for the torch backends, tokenizer and engine config "
        "always); 'generated:tiny-qwen3' builds a tiny random model. Required.")
    ref_load: str | None = knob(None, "miles' reference checkpoint (megatron torch_dist): accepted so that "
                                "miles command lines run, NOT read: both trainer backends start from "
                                "--hf-checkpoint (megatron through Tandem's own HF->megatron mapper) and "
                                "the reference policy is the actor's initial weights")
    load: str | None = knob(None, "checkpoint dir to resume the actor from")
    save: str | None = knob(None, "checkpoint dir for the actor")
    save_interval: int | None = knob(None, "save every N rollouts", ge=1)
    save_keep_last: int | None = knob(None, "keep only the newest N checkpoints under --save (and the "
                                      "critic's); unset keeps all (miles has no such flag)", ge=1)
    max_trainer_restarts: int = knob(0, "a dead trainer rank brings the trainers back from the newest checkpoint "
                                     "under --save, and the run goes on from there, at most N times (0: the run "
                                     "stops, to be resumed with --load)", ge=0)
    save_on_signal: bool = knob(False, "SIGTERM saves a checkpoint at the end of the rollout under way and then "
                                "stops, as SIGUSR1 always does with --save (schedulers send SIGTERM before "
                                "they kill); without it SIGTERM stops at once")
    save_hf: str | None = knob(None, "also save HF weights to this path "
                               "('{rollout_id}' is filled in)")
    critic_load: str | None = knob(None, "critic checkpoint dir to resume from; falls back to --load + '_critic'")
    critic_save: str | None = knob(None, "critic checkpoint dir; falls back to --save + '_critic'")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    prompt_data: str | None = knob(None, "prompt jsonl; 'generated:arithmetic' builds a synthetic "
                                   "task. Required.")
    input_key: str = knob("input", "jsonl key of the prompt")
    label_key: str | None = knob(None, "jsonl key of the label given to the reward function")
    apply_chat_template: bool = knob(False, "format prompts with the tokenizer's chat template")
    rollout_batch_size: int | None = knob(None, "prompts per rollout. Required.", ge=1)
    n_samples_per_prompt: int = knob(1, "responses sampled per prompt", ge=1)
    rollout_max_prompt_len: int | None = knob(None, "drop prompts longer than this", ge=1)
    skip_bad_samples: bool = knob(False, "skip unusable prompt lines (malformed, empty, too long) "
                                  "and count them as rollout/skipped_samples, instead of failing "
                                  "on the first with its file:line")
    rollout_max_response_len: int | None = knob(None, "max new tokens per response", ge=1)
    rollout_temperature: float = knob(1.0, ge=0.0)
    rollout_top_p: float = knob(1.0, gt=0.0, le=1.0)
    rollout_top_k: int = knob(-1, "-1 disables top-k")
    rollout_stop_token_ids: tuple[int, ...] | None = knob(None, "extra stop token ids", ge=0)
    rollout_stop: tuple[str, ...] | None = knob(
        None, "miles' stop strings, here each one token of the tokenizer (the engines stop on token ids), "
        "kept in the response: e.g. </tool_call> ends a turn at its tool call (docs/multi_turn.md)")
    num_rollout: int | None = knob(None, "number of PPO iterations. Required.", ge=1)
    rollout_seed: int = knob(42, "seed of prompt shuffling and sampling")
    rollout_shuffle: bool = knob(False, "shuffle prompts each epoch")
    over_sampling_batch_size: int | None = knob(
        None, "dynamic sampling: prompts per sampling round, >= --rollout-batch-size; rounds go on "
        "until --rollout-batch-size groups pass the filter; --partial-rollout: groups started per rollout. "
        "Unset: --rollout-batch-size", ge=1)
    dynamic_sampling_filter_path: str | None = knob(
        None, "dynamic sampling (DAPO): function that keeps or drops each prompt's group of samples, "
        "as --custom-rm-path names one; built in: ppo.generate.dynamic_sampling.check_reward_nonzero_std "
        "(drop groups whose rewards are all equal: no GRPO signal)")
    train_async: bool = knob(
        False, "miles' train_async.py: generate the next rollout while this one trains (one-step "
        "off-policy; engines on their own GPUs, or with --colocate side by side with the trainers on the "
        "same GPUs, each in its memory budget, SMs shared under MPS), corrected by decoupled PPO: TIS weights "
        "of the trainer's log-probs before the update against the engine's (docs/algorithms.md)")
    max_weight_staleness: int = knob(
        1, "--train-async: a group generated more than N weight versions before the one training on it "
        "is generated again (miles' flag; the schedule keeps samples 1 version old)", ge=1)
    dynamic_sampling_max_extra_rounds: int = knob(
        8, "dynamic sampling: at most this many sampling rounds after the first; then the batch is "
        "filled up with dropped groups (counted as rollout/dynamic_sampling_filled_groups) "
        "(miles has no cap)", ge=0)
    partial_rollout: bool = knob(
        False, "miles' flag: start --over-sampling-batch-size groups, stop once --rollout-batch-size are "
        "complete, abort what is in flight on every engine and continue the unfinished samples (tokens, "
        "log-probs, weight versions) first in the next rollout (docs/partial_rollouts.md)")
    mask_offpolicy_in_partial_rollout: bool = knob(
        False, "--partial-rollout: loss mask 0 on a sample's tokens generated in earlier rollouts (miles' flag); "
        "unset, they train, corrected by their per-token weight versions")


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    rm_type: str | None = knob(None, "built-in reward function, or remote_rm: a reward service at --rm-url "
                               "(required unless --custom-rm-path)")
    custom_rm_path: str | None = knob(None, "import path of a custom reward function; replaces "
                                      "--rm-type")
    rm_url: str | None = knob(None, "--rm-type remote_rm: the reward service's http URL; one POST of "
                              "{prompt, response, label} per sample, answered by a JSON number or object "
                              "(miles' format)")
    rm_max_retries: int = knob(2, "remote_rm: tries after a failed request (no connection, --reward-timeout "
                               "passed, HTTP 5xx or 429), with backoff; then the sample scores 0", ge=0)
    rm_max_concurrency: int = knob(32, "remote_rm: requests in flight at once, per scorer process", ge=1)
    reward_key: str | None = knob(None, "a reward function or service that answers with a dict: the key "
                                  "of the reward in it (miles)")
    custom_reward_post_process_path: str | None = knob(
        None, "function given the rollout's scored samples (a list of sample dicts with 'reward') that "
        "returns one reward per sample, named as --custom-rm-path names one (miles' flag; miles' "
        "function also gets args and returns raw and processed rewards)")
    reward_model_path: str | None = knob(
        None, "HF sequence-classification checkpoint with one label (a Bradley-Terry reward model) that "
        "scores each rollout on GPUs, beside or instead of --rm-type (verl: reward_model.model.path)")
    reward_model_coef: float = knob(1.0, "the reward is --rule-reward-coef x the rule's (or --custom-rm-path's, "
                                    "or the service's) + this x the reward model's score")
    rule_reward_coef: float = knob(1.0, "weight of the rule reward when a reward model scores too")
    reward_model_num_gpus: int = knob(
        0, "GPUs of the reward model's own, one scorer rank each; 0: a rank on each of the engines' GPUs, "
        "where it takes its turn in the memory handoff", ge=0)
    reward_model_max_tokens_per_gpu: int = knob(
        8192, "padded tokens per reward-model micro-batch (verl: reward_model.forward_max_token_len_per_gpu)", ge=1)
    num_reward_workers: int = knob(1, "reward scorer processes (CPU)", ge=1)
    reward_timeout: float = knob(30.0, "seconds allowed to score one sample (remote_rm: one request)", gt=0.0)


@dataclass(frozen=True, kw_only=True)
class PPOAlgoConfig:
    advantage_estimator: str = knob("grpo", "'ppo' adds a critic and uses GAE",
                                    choices=ADVANTAGE_ESTIMATORS)
    gamma: float = knob(1.0, "GAE discount", ge=0.0, le=1.0)
    lambd: float = knob(1.0, "GAE lambda", ge=0.0, le=1.0)
    eps_clip: float = knob(0.2, "PPO ratio clip range", gt=0.0, lt=1.0)
    eps_clip_high: float | None = knob(None, "upper clip range; falls back to --eps-clip", gt=0.0)
    eps_clip_c: float | None = knob(None, "dual-clip PPO lower bound (off when unset)", gt=1.0)
    value_clip: float = knob(0.2, "critic value clip range", gt=0.0)
    use_kl_loss: bool = knob(False, "add a KL(actor || ref) term to the policy loss")
    kl_loss_coef: float = knob(0.0, "weight of the KL loss term", ge=0.0)
    kl_loss_type: str = knob("k1", choices=KL_LOSS_TYPES)
    kl_coef: float = knob(0.0, "reward-level KL penalty, applied before advantages", ge=0.0)
    entropy_coef: float = knob(0.0, "entropy bonus weight", ge=0.0)
    normalize_advantages: bool = knob(False, "whiten advantages over the batch")
    num_critic_only_steps: int | None = knob(
        None, "first N rollouts train only the critic (value warm-up); unset: 1 with a critic "
        "(the miles PPO example), 0 without one", ge=0)
    use_tis: bool = knob(False, "truncated importance sampling: weight each token's policy loss by "
                         "clamp(p_train / p_rollout, --tis-clip-low, --tis-clip), correcting for the "
                         "engine's log-probs differing from the trainer's")
    tis_clip: float = knob(2.0, "TIS upper bound C on the importance weights", gt=0.0)
    tis_clip_low: float = knob(0.0, "TIS lower bound on the importance weights", ge=0.0)
    custom_tis_function_path: str | None = knob(
        None, "TIS function in place of the truncated one, named as --custom-rm-path names one; "
        "built in: algorithms.mismatch:masked_is (icepop: tokens outside the bounds get weight 0) "
        "and algorithms.mismatch:sequence_masked_is (whole responses rejected)")
    use_rollout_logprobs: bool = knob(False, "take the PPO ratio against the engine's log-probs "
                                      "instead of the trainer's recomputed ones")
    get_mismatch_metrics: bool = knob(False, "log training-inference mismatch metrics (train/mis_*: "
                                      "kl, k3_kl, ppl, chi2) of trainer vs engine log-probs")
    loss_agg_mode: str = knob("sum-of-sample-mean", choices=LOSS_AGG_MODES)
    num_steps_per_rollout: int | None = knob(
        None, "optimizer steps per rollout; sets the global batch size when that is unset", ge=1)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    optimizer: str = knob("adam", choices=OPTIMIZERS)
    lr: float = knob(1e-6, "actor learning rate", gt=0.0)
    min_lr: float = knob(0.0, "floor of the decayed learning rate", ge=0.0)
    lr_decay_style: str = knob("linear", choices=LR_DECAY_STYLES)
    lr_warmup_iters: int = knob(0, "linear warm-up steps", ge=0)
    weight_decay: float = knob(0.01, ge=0.0)
    adam_beta1: float = knob(0.9, ge=0.0, lt=1.0)
    adam_beta2: float = knob(0.999, ge=0.0, lt=1.0)
    clip_grad: float = knob(1.0, "gradient norm clip (0 disables)", ge=0.0)
    critic_lr: float | None = knob(None, "falls back to --lr", gt=0.0)
    critic_weight_decay: float | None = knob(None, "falls back to --weight-decay", ge=0.0)
    critic_lr_warmup_iters: int | None = knob(None, "falls back to --lr-warmup-iters", ge=0)
    optimizer_cpu_offload: bool = knob(
        False, "megatron-core's optimizer CPU offload: --optimizer-offload-fraction of the float32 main "
        "params and Adam moments stay in host memory and step on the CPU. The memory plan (--dry-run) "
        "counts it; the megatron trainer does not build it yet, so a run with it stops at start-up")
    optimizer_offload_fraction: float = knob(1.0, "the optimizer state's share kept on the CPU with "
                                             "--optimizer-cpu-offload", ge=0.0, le=1.0)


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    train_backend: str = knob("megatron", choices=TRAIN_BACKENDS)
    global_batch_size: int | None = knob(
        None, "samples per optimizer step; unset: rollout samples / --num-steps-per-rollout "
        "(one step per rollout when both are unset)", ge=1)
    micro_batch_size: int = knob(1, "samples per forward pass (ignored with dynamic batching)",
                                 ge=1)
    use_dynamic_batch_size: bool = knob(False, "pack micro batches up to --max-tokens-per-gpu")
    max_tokens_per_gpu: int | None = knob(None, "token budget per micro batch and GPU", ge=1)
    recompute_granularity: str | None = knob(
        None, "activation recompute: full (whole layers, picked by --recompute-method and "
        "--recompute-num-layers) or selective (megatron: core attention); unset: none",
        choices=RECOMPUTE_GRANULARITIES)
    recompute_method: str | None = knob(
        None, "full recompute: uniform (every layer, in units of --recompute-num-layers) or "
        "block (the first --recompute-num-layers layers of each pipeline stage)",
        choices=RECOMPUTE_METHODS)
    recompute_num_layers: int | None = knob(None, "layers per recompute unit (uniform) or "
                                            "recomputed per stage (block)", ge=1)
    transformer_impl: str = knob(
        "local", "megatron's layers: local (megatron's local spec with the built-in SDPA/varlen "
        "attention) or transformer_engine (its fused layers; needs transformer-engine installed)",
        choices=TRANSFORMER_IMPLS)
    seed: int = knob(1234, "seed of model init and training")
    max_skipped_updates: int = knob(
        10, "stop the run when more optimizer steps than this were skipped for a non-finite "
        "loss or gradient (each skip leaves the weights untouched)", ge=0)


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """The actor's model parallelism; the critic always inherits it (as in miles)."""

    tensor_model_parallel_size: int = knob(1, ge=1)
    pipeline_model_parallel_size: int = knob(1, ge=1)
    context_parallel_size: int = knob(1, ge=1)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    rollout_backend: str = knob("sglang", choices=ROLLOUT_BACKENDS)
    rollout_num_gpus_per_engine: int = knob(1, "GPUs per engine (the engine's TP size)", ge=1)
    sglang_mem_fraction_static: float | None = knob(None, "sglang's default when unset",
                                                    gt=0.0, lt=1.0)
    sglang_max_running_requests: int | None = knob(
        None, "requests an engine decodes at once; unset: the samples of one rollout", ge=1)
    sglang_dp_size: int = knob(1, "sglang's data-parallel replicas per engine; only 1 works with "
                               "weight updates from tensors (use more engines instead)", ge=1)
    sglang_disable_cuda_graph: bool = knob(False, "run sglang's decode without CUDA graphs")
    sglang_enable_deterministic_inference: bool = knob(
        False, "sglang samples with each request's seed only in this mode (batch-invariant "
        "kernels, pytorch sampler: slower); otherwise samples do not reproduce per request. "
        "The torch backend: its batch_invariant option (bf16 tokens independent of the batch; "
        "0.27-0.74x the tokens/s on the H200)")
    rollout_max_request_retries: int = knob(
        3, "how often a request its engine aborts (sglang's aborts, out of memory) is issued again, "
        "with its seed, before the run stops naming it", ge=0)
    update_weight_buffer_size: int = knob(512 * 1024**2, "bytes per weight-sync bucket; the "
                                           "sender holds two such buffers per dtype (double buffering)", ge=1)
    check_weight_update_equal: bool = knob(False, "verify engine weights after each sync (slow)")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where roles run. The critic has no flags: it sits on the actor's GPUs (as in miles)."""

    actor_num_nodes: int = knob(1, ge=1)
    actor_num_gpus_per_node: int | None = knob(
        None, "GPUs per node for the actor (and the critic); unset: all of --num-gpus-per-node", ge=1)
    num_gpus_per_node: int = knob(8, "GPUs each node has", ge=1)
    rollout_num_gpus: int | None = knob(
        None, "GPUs for engines; with --colocate it is the actor's GPU count", ge=1)
    colocate: bool = knob(False, "actor, critic and engines share GPUs, offloading in turn")
    offload_train: bool | None = knob(
        None, "offload trainers while engines generate; on with --colocate or a critic")
    offload_rollout: bool | None = knob(
        None, "release engine weights and KV cache while trainers run; on with --colocate")
    offload_train_level: str = knob(
        "all", "what an offloading trainer frees when it hands its GPUs over: all, or optimizer "
        "(optimizer and grads; the weights stay, for plans where both trainers' weights fit)",
        choices=OFFLOAD_TRAIN_LEVELS)
    offload_rollout_level: str = knob(
        "all", "what an offloading engine releases: all (weights and KV cache), or kv_cache "
        "(the weights stay)", choices=OFFLOAD_ROLLOUT_LEVELS)
    fake_gpus: bool = knob(False, "CPU run: roles compute on the CPU with fake GPU memory ledgers")
    # Side by side (--train-async --colocate), MPS's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per role and
    # the trainers' CUDA_MPS_CLIENT_PRIORITY. Measured on the H200 (GRPO, Qwen3-4B, steady
    # iteration against the synchronous one; docs/journal/, "Side by side at shares"): 50/50 1.00x,
    # 50/100 with the trainers below_normal 0.99x, 100/100 below_normal 0.91x. cuBLAS leaves GEMM
    # outputs unwritten in a client at 60 or 75% (the first default, 25/75, made every update NaN)
    # and is right at 25, 50, 90, 100 (roles.compute_check, which the launcher runs in each role's client)
    engine_sm_percentage: int = knob(
        100, "side by side: the share of the GPU's SMs (percent) MPS gives each engine", ge=1, le=100)
    trainer_sm_percentage: int = knob(
        100, "side by side: the share of the GPU's SMs (percent) MPS gives each trainer", ge=1, le=100)
    trainer_mps_priority: str = knob(
        "below_normal", "side by side: how MPS schedules the trainers' work against the engine's: normal, "
        "or below_normal (the engine's ready kernels go first and the trainers fill the SMs it "
        "leaves idle; CUDA_MPS_CLIENT_PRIORITY)", choices=MPS_PRIORITIES)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Which node of a multi-node job this launcher is (docs/multinode.md). Unset fields come from
    Slurm's or torchrun's environment (ppo.config.cluster); flags win over it. Unset everywhere:
    one host, as without these flags."""

    nnodes: int | None = knob(None, "nodes in the job, one launcher each; unset: SLURM_STEP_NUM_TASKS or "
                              "torchrun's, else one host", ge=1)
    node_rank: int | None = knob(None, "this launcher's node; 0 runs the driver and hosts the rendezvous "
                                 "store; unset: SLURM_PROCID or torchrun's GROUP_RANK", ge=0)
    master_addr: str | None = knob(None, "node 0's address, where the rendezvous store listens; unset: "
                                   "MASTER_ADDR or the first host of SLURM_STEP_NODELIST")
    master_port: int = knob(29500, "the rendezvous store's port on node 0 (torchrun's default); "
                            "under torchrun or srun, MASTER_PORT when set", ge=1, le=65535)
    node_ip: str | None = knob(None, "the address this node's control sockets bind; unset: the one "
                               "that routes to --master-addr (never 0.0.0.0)")
    rendezvous_timeout_s: float = knob(60.0, "how long a node waits for node 0's store and for the "
                                       "other nodes before it stops", gt=0)


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    run_dir: str = knob("runs/ppo", "logs, events, config.json and error files go here; on the "
                        "command line the default is runs/<recipe>-<date>-<time>")
    use_tensorboard: bool = knob(False, "metrics to run_dir/tensorboard too (the `logging` extra); a "
                                 "rewind or --load hides the steps run again (purge_step)")
    use_wandb: bool = knob(False, "metrics to wandb too (the `logging` extra), against rollout/step and "
                           "eval/step; --load goes on in the run's wandb run (run_dir/wandb_run_id)")
    wandb_project: str | None = knob(None)
    dump_samples: bool = knob(True, "write each rollout's prompts, responses and rewards to "
                              "run_dir/samples as jsonl")
    log_format: str = knob("auto", "what the run prints: a progress bar on a terminal and one line "
                           "per rollout otherwise (auto), or always rich, plain or json lines",
                           choices=LOG_FORMATS)
    quiet: bool = knob(False, "print nothing but errors (metrics still go to run_dir/metrics.jsonl)")
    log_interval_s: float = knob(30.0, "plain and json output: a progress line at least this often "
                                 "during a long step", gt=0)


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Evaluation during training on held-out prompt sets (miles' eval flags; ppo.generate.evaluation).
    An unset key or sampling setting falls back to the rollout's, as in miles."""

    eval_prompt_data: tuple[str, ...] | None = knob(
        None, "held-out prompt sets as NAME PATH pairs, e.g. aime /data/aime.jsonl "
        "('generated:arithmetic_heldout' builds the sums tiny_ppo does not train on)")
    eval_interval: int | None = knob(None, "evaluate after every N rollouts, and before the first "
                                     "unless --skip-eval-before-train; unset: never", ge=1)
    skip_eval_before_train: bool = knob(False, "do not evaluate the initial weights before the first rollout")
    eval_input_key: str | None = knob(None, "jsonl key of the eval prompt; falls back to --input-key")
    eval_label_key: str | None = knob(None, "jsonl key of the eval label; falls back to --label-key")
    n_samples_per_eval_prompt: int = knob(1, "responses sampled per eval prompt (pass@k for k = 1, 2, "
                                          "4, ... up to it)", ge=1)
    eval_temperature: float | None = knob(None, "falls back to --rollout-temperature", ge=0.0)
    eval_top_p: float | None = knob(None, "falls back to --rollout-top-p", gt=0.0, le=1.0)
    eval_top_k: int | None = knob(None, "falls back to --rollout-top-k; -1 disables top-k")
    eval_max_response_len: int | None = knob(None, "falls back to --rollout-max-response-len", ge=1)
    eval_rm_type: tuple[str, ...] | None = knob(
        None, "reward rule of the eval sets: one for all, or one per set in --eval-prompt-data order "
        "(miles' per-dataset rm_type); unset: --rm-type")


@dataclass(frozen=True, kw_only=True)
class ToolsConfig:
    """The sandbox each tool call of a multi-turn rollout runs in (roles.tools; docs/tools.md);
    the tools themselves are GenerateConfig's (miles' flags)."""

    tool_sandbox: bool = knob(True, "run each tool call in a bubblewrap sandbox with the limits below; off: in the "
                              "driver's process with the timeout and output cut only, for trusted plain-Python tools")
    num_tool_workers: int = knob(2, "tool worker processes (threads without the sandbox): calls that run at once",
                                 ge=1)
    tool_timeout: float = knob(10.0, "seconds of wall clock a tool call may take", gt=0.0)
    tool_cpu_seconds: int = knob(5, "seconds of CPU time a tool call may use (RLIMIT_CPU)", ge=1)
    tool_memory_mb: int = knob(1024, "address space of each process of a tool call (RLIMIT_AS), in MiB; "
                               "Python itself needs about 64", ge=64)
    tool_max_processes: int = knob(32, "processes a tool call may have at once (RLIMIT_NPROC)", ge=1)
    tool_max_file_mb: int = knob(64, "MiB a tool call may write: its work dir's size and the largest file "
                                 "(RLIMIT_FSIZE)", ge=1)
    tool_max_output_chars: int = knob(8192, "a tool's answer is cut here (and counted as an output_limit "
                                      "error)", ge=1)


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """Per-trajectory generation (ppo.generate, docs/multi_turn.md); miles' flags."""

    custom_generate_function_path: str | None = knob(
        None, "async def generate(args, sample, sampling_params) that runs one trajectory (module:function, "
        "as --custom-rm-path names one); unset: one response per prompt, or the built-in tool loop "
        "(ppo.generate.tool_loop:generate) when --generate-tool-specs-path is set")
    generate_tool_specs_path: str | None = knob(
        None, "the tools' OpenAI-style specs: a .json file, or a list or a function returning one (module:name)")
    generate_execute_tool_function_path: str | None = knob(
        None, "execute(name, arguments) -> str, sync or async, that runs one tool call (module:function)")
    generate_tool_call_parser: str = knob("qwen25", "how tool calls are written: <tool_call>{json}</tool_call>",
                                          choices=TOOL_CALL_PARSERS)
    generate_max_turns: int = knob(16, "most model turns of one trajectory (the tool loop)", ge=1)
    custom_agent_function_path: str | None = knob(
        None, "async def run_agent(base_url, prompt, request_kwargs, metadata, **kwargs) that runs one agent "
        "session against the OpenAI-compatible session server (module:function; docs/agents.md)")


@dataclass(frozen=True, kw_only=True)
class PPOConfig:
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOAlgoConfig = field(default_factory=PPOAlgoConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)


@dataclass(frozen=True)
class FieldSpec:
    """One leaf field of `PPOConfig`, seen flat: `group.name` <-> `--name-with-dashes`."""

    group: str
    name: str
    kind: type  # bool, int, float, str, or tuple (of `item`s)
    optional: bool
    meta: typing.Mapping[str, Any]
    item: type = int  # what a tuple holds: int or str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def path(self) -> str:
        return f"{self.group}.{self.name}"


def _split_type(tp: Any) -> tuple[type, bool, type]:
    optional, item = False, int
    if isinstance(tp, types.UnionType):
        args = [a for a in tp.__args__ if a is not type(None)]
        assert len(args) == 1, f"unsupported config type {tp}"
        tp, optional = args[0], True
    if typing.get_origin(tp) is tuple:
        assert typing.get_args(tp) in ((int, ...), (str, ...)), f"unsupported config type {tp}"
        tp, item = tuple, typing.get_args(tp)[0]
    assert tp in (bool, int, float, str, tuple), f"unsupported config type {tp}"
    return tp, optional, item


def _index_fields() -> dict[str, FieldSpec]:
    index: dict[str, FieldSpec] = {}
    for group in dataclasses.fields(PPOConfig):
        group_cls = group.default_factory
        hints = typing.get_type_hints(group_cls)
        for f in dataclasses.fields(group_cls):
            assert f.name not in index, f"config field {f.name} is defined twice"
            kind, optional, item = _split_type(hints[f.name])
            index[f.name] = FieldSpec(group.name, f.name, kind, optional, f.metadata, item)
    return index


# Flat name -> spec, in declaration order; the CLI, the validator and (de)serialisation use it.
FIELDS: dict[str, FieldSpec] = _index_fields()
