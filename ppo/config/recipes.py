"""Named recipes: documented functions returning a complete `PPOConfig`.

Recipes share their pieces, so `tiny_ppo` runs the same PPO algorithm as `qwen3_4b_ppo`,
shrunk to fake GPUs and a tiny generated model. Values a user is expected to change
(paths, batch sizes) are plain keyword arguments of the pieces, and any field can be
overridden on the command line by its flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ppo.config import (
    CheckpointConfig,
    EngineConfig,
    EvalConfig,
    GenerateConfig,
    OptimizerConfig,
    ParallelismConfig,
    PlacementConfig,
    PPOAlgoConfig,
    PPOConfig,
    RewardConfig,
    RolloutConfig,
    TrainingConfig,
    override,
)


def ppo_algorithm() -> PPOAlgoConfig:
    """The miles PPO example's algorithm: GAE with a critic that warms up for one rollout
    (--num-critic-only-steps unset: 1 with the critic, 0 when another estimator drops it),
    whitened advantages, clip 0.2, and the KL loss wired in at weight 0 (so no reference
    forward is scheduled until --kl-loss-coef is raised)."""
    return PPOAlgoConfig(
        advantage_estimator="ppo",
        normalize_advantages=True,
        use_kl_loss=True,
        kl_loss_coef=0.0,
        kl_loss_type="k1",
        kl_coef=0.0,
        entropy_coef=0.0,
        eps_clip=0.2,
    )


def adam(*, lr: float, critic_lr: float) -> OptimizerConfig:
    """Adam with a constant LR, weight decay 0.1 and betas (0.9, 0.98), as in miles' example."""
    return OptimizerConfig(
        optimizer="adam",
        lr=lr,
        critic_lr=critic_lr,
        lr_decay_style="constant",
        weight_decay=0.1,
        adam_beta1=0.9,
        adam_beta2=0.98,
    )


def math_prompts(path: str, **rollout: object) -> RolloutConfig:
    """A jsonl of {"prompt", "label"} math problems, shuffled; `rollout` sets the sizes."""
    return RolloutConfig(prompt_data=path, input_key="prompt", label_key="label",
                         rollout_shuffle=True, **rollout)


def qwen3_4b_ppo() -> PPOConfig:
    """Qwen3-4B PPO on DAPO-Math-17k, one node of 4 GPUs, colocated (the miles PPO example).

    The paths are placeholders in miles' layout: pass --hf-checkpoint (HF dir, also the
    tokenizer; `python -m ppo.make_model --arch qwen3-4b DIR` writes an untrained one),
    --ref-load (miles' torch_dist conversion of it: kept for parity, not read) and
    --prompt-data. As miles ships it:
    the actor (and so the critic) is one data-parallel rank of TP1 x PP2 x CP2 over the
    node's 4 GPUs, with one sglang engine per GPU; `--num-gpus-per-node 8` gives two ranks.
    """
    return PPOConfig(
        checkpoint=CheckpointConfig(
            hf_checkpoint="/root/models/Qwen3-4B",
            ref_load="/root/models/Qwen3-4B_torch_dist",
            load="runs/qwen3_4b_ppo/checkpoints",
            save="runs/qwen3_4b_ppo/checkpoints",
            save_interval=20,
        ),
        rollout=math_prompts(
            "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl",
            apply_chat_template=True,
            num_rollout=300,
            rollout_batch_size=8,
            n_samples_per_prompt=8,
            rollout_max_response_len=8192,
            rollout_temperature=0.8,
        ),
        reward=RewardConfig(rm_type="deepscaler"),
        ppo=ppo_algorithm(),
        optimizer=adam(lr=1e-6, critic_lr=1e-5),
        training=TrainingConfig(
            train_backend="megatron",
            global_batch_size=32,
            use_dynamic_batch_size=True,
            max_tokens_per_gpu=16384,
        ),
        parallelism=ParallelismConfig(
            tensor_model_parallel_size=1, pipeline_model_parallel_size=2, context_parallel_size=2),
        engine=EngineConfig(
            rollout_backend="sglang",
            rollout_num_gpus_per_engine=1,
            sglang_mem_fraction_static=0.8,
            sglang_max_running_requests=512,
        ),
        placement=PlacementConfig(actor_num_nodes=1, num_gpus_per_node=4, colocate=True),
    )


def qwen3_4b_ppo_1gpu() -> PPOConfig:
    """Qwen3-4B PPO on one GPU of 141 GB (H200): 64 x 2048-token responses, the measured plan.

    qwen3_4b_ppo with everything on GPU 0: megatron actor and critic at TP1 PP1 CP1 with full
    recompute, the built-in engine taking 22% of the GPU. Both trainers keep their bf16
    weights on the GPU and move only their optimizers to pinned host memory around their
    train calls (about 100 GiB of host memory); the engine keeps its weights and KV cache.
    docs/journal/, "qwen3_4b_ppo on one GPU", has the iteration this plan measured and
    why it fits; `bench/qwen3_4b_one_gpu.sh` runs it. Longer responses need another memory
    plan (the script's RESPONSE_LEN > 2048 branch), an 80 GB GPU `qwen3_4b_ppo_1gpu_80gb`.
    """
    return override(
        qwen3_4b_ppo(),
        load="runs/qwen3_4b_ppo_1gpu/checkpoints",
        save="runs/qwen3_4b_ppo_1gpu/checkpoints",
        rollout_max_response_len=2048,
        num_gpus_per_node=1,
        actor_num_gpus_per_node=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
        rollout_backend="torch",
        sglang_mem_fraction_static=0.22,
        offload_train_level="optimizer",
        offload_rollout=False,
    )


def qwen3_4b_ppo_1gpu_80gb() -> PPOConfig:
    """Qwen3-4B PPO on one 80 GB GPU (H100, A100 80GB, H800): the one-GPU recipe, moving more.

    A train call holds its trainer's whole state (bf16 weights 7.5 GiB, float32 grads 15 and
    optimizer 45) and its activations, so nothing else may stay beside it: the engine frees its
    weights and KV cache once it has generated, and each trainer moves its weights as well as its
    optimizer to pinned host memory between its calls (~113 GiB pinned in all). Micro-batches of
    8k tokens leave 4 GiB of the 79.6 GiB free in the actor's train call; the engine takes 40%
    of the GPU, a KV cache for 64 responses of 2048 tokens. The trainers build one after the
    other (the memory plan, `--dry-run`, shows each phase).
    """
    return override(
        qwen3_4b_ppo_1gpu(),
        load="runs/qwen3_4b_ppo_1gpu_80gb/checkpoints",
        save="runs/qwen3_4b_ppo_1gpu_80gb/checkpoints",
        offload_train_level="all",
        offload_rollout=True,
        offload_rollout_level="all",
        sglang_mem_fraction_static=0.4,
        max_tokens_per_gpu=8192,
    )


def tiny_ppo() -> PPOConfig:
    """CPU PPO on 2 fake GPUs: a generated tiny Qwen3 learns generated two-digit sums.

    The algorithm of qwen3_4b_ppo with torch backends, plus a KL loss to the warm start
    (low_var_kl at 0.1); actor, critic and two one-GPU engines share both fake GPUs. The task
    is `generated:column_sums_small` (sums without a carry of operands with tens 1..3 and
    units 0..3, `23+13=` -> `36`, graded digit by digit). Sizes are tuned for the 2-core CPU
    machine: the mean reward goes from about 0.1 (chance) to 0.48-0.93 by rollouts 36-40 and
    0.87-0.96 by rollouts 96-100 (the default seeds and seeds 0-2), in 1.5-2 minutes. Every 5
    rollouts (and before the first) the engines are evaluated, 16 samples per sum, on the 12
    sums training never shows, whose columns it does (`generated:column_sums_small_heldout`),
    and on 12 it trains on (`generated:column_sums_small_seen`): held-out pass@1 rises from
    about 0.01 to 0.8-1.0 on seeds 0, 1, 2 (docs/evaluation.md).
    """
    return PPOConfig(
        checkpoint=CheckpointConfig(hf_checkpoint="generated:tiny-qwen3"),
        rollout=math_prompts(
            "generated:column_sums_small",
            num_rollout=100,
            rollout_batch_size=128,  # at 64 the reward of the default seeds rose 0.22 by rollout 40
            n_samples_per_prompt=8,
            rollout_max_response_len=4,
            rollout_temperature=1.0,
        ),
        reward=RewardConfig(rm_type="tiny_digits"),
        # without the KL loss (and at lr 1e-3) the held-out pass@1 stalls at 0.17 (docs/evaluation.md)
        ppo=dataclasses.replace(ppo_algorithm(), kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
        optimizer=adam(lr=2e-3, critic_lr=1e-3),
        training=TrainingConfig(train_backend="torch", global_batch_size=128, micro_batch_size=64),
        engine=EngineConfig(rollout_backend="torch", rollout_num_gpus_per_engine=1),
        placement=PlacementConfig(actor_num_nodes=1, actor_num_gpus_per_node=2,
                                  num_gpus_per_node=2, colocate=True, fake_gpus=True),
        evaluation=EvalConfig(eval_prompt_data=("column_sums_small_heldout", "generated:column_sums_small_heldout",
                                                "column_sums_small_seen", "generated:column_sums_small_seen"),
                              eval_interval=5, n_samples_per_eval_prompt=16),
    )


def tiny_tools() -> PPOConfig:
    """CPU PPO with a tool: a tiny Qwen3 learns three-digit sums by calling a calculator.

    tiny_ppo's placement on `generated:tool_sums` (`347+285=`, operands 100..499, carries) through
    the built-in tool loop: the model calls `calculator` in Qwen's `<tool_call>{json}</tool_call>`
    format (its turn stops at `</tool_call>`), reads the result in the tool turn its chat template
    renders, and answers (ppo.generate.tiny_tools). It starts knowing the call format but
    answering at random, so PPO has to learn to copy the tool's result; the answer after the last
    tool turn is graded digit by digit. tiny_tools_no_tool is the same task without the tool.

    GRPO (no critic) on 64 prompts x 8 samples, 16 optimizer steps of 32 a rollout, the LR
    warming up over 40 of them: the 40th rollout's reward is 0.83 (median of seeds 1234, 1, 2:
    0.93, 0.68, 0.83), 0.13 without the tool (docs/multi_turn.md).
    tiny_ppo's PPO with a critic, on 128 prompts and 8 steps a rollout, was at 0.19 by rollout
    40. At 1e-3 and 2e-3 without the warm-up, the first update's Adam steps garbled the call and
    the reward fell to 0 for good.
    """
    base = tiny_ppo()
    return dataclasses.replace(
        base,
        checkpoint=CheckpointConfig(hf_checkpoint="generated:tiny-qwen3-tools"),
        # a turn ends at its call (the stop token stays in the response): no turn carries text after
        # its call, which an OpenAI message could not hold (tiny_tools_agent: docs/agents.md)
        rollout=dataclasses.replace(base.rollout, prompt_data="generated:tool_sums", num_rollout=40,
                                    rollout_batch_size=64, rollout_max_response_len=30, rollout_stop=("</tool_call>",)),
        reward=RewardConfig(custom_rm_path="ppo.generate.tiny_tools:answer_reward"),
        ppo=dataclasses.replace(base.ppo, advantage_estimator="grpo"),
        optimizer=dataclasses.replace(base.optimizer, lr=2e-3, lr_warmup_iters=40),
        training=dataclasses.replace(base.training, global_batch_size=32, micro_batch_size=16),
        evaluation=EvalConfig(eval_prompt_data=("tool_sums", "generated:tool_sums_eval"), eval_interval=40,
                              n_samples_per_eval_prompt=1),
        # the calculator is trusted code of ours: in process (a sandbox per call costs ~0.2 s of a rollout's 512)
        tools=dataclasses.replace(base.tools, tool_sandbox=False),
        generate=GenerateConfig(generate_tool_specs_path="roles.tools.calculator:TOOL_SPECS",
                                generate_execute_tool_function_path="roles.tools.calculator:execute_tool",
                                generate_max_turns=2),
    )


def tiny_tools_no_tool() -> PPOConfig:
    """tiny_tools without the tool: the same sums answered directly, by a model warm-started to
    answer three random digits; it stays near chance (the baseline tiny_tools is measured against):
    0.100 -> 0.126 in 40 rollouts, seed 1234 (2026-12-07)."""
    base = tiny_tools()
    return dataclasses.replace(base, checkpoint=CheckpointConfig(hf_checkpoint="generated:tiny-qwen3"),
                               rollout=dataclasses.replace(base.rollout, rollout_max_response_len=5, rollout_stop=None),
                               generate=GenerateConfig())


def tiny_tools_agent() -> PPOConfig:
    """tiny_tools with the task written as an agent against the OpenAI client
    (ppo.generate.agents.tiny_agent), served by the session server (docs/agents.md)."""
    base = tiny_tools()
    return dataclasses.replace(base, generate=GenerateConfig(custom_agent_function_path="ppo.generate.agents.tiny_agent:run_agent"))


RECIPES: dict[str, Callable[[], PPOConfig]] = {
    "qwen3_4b_ppo": qwen3_4b_ppo,
    "qwen3_4b_ppo_1gpu": qwen3_4b_ppo_1gpu,
    "qwen3_4b_ppo_1gpu_80gb": qwen3_4b_ppo_1gpu_80gb,
    "tiny_ppo": tiny_ppo,
    "tiny_tools": tiny_tools,
    "tiny_tools_no_tool": tiny_tools_no_tool,
    "tiny_tools_agent": tiny_tools_agent,
}
DEFAULT_RECIPE = "tiny_ppo"


def describe_recipes() -> str:
    """One line per recipe: its name and the first line of its docstring."""
    width = max(map(len, RECIPES))
    return "\n".join(f"{name:<{width}}  {fn.__doc__.strip().splitlines()[0]}"
                     for name, fn in RECIPES.items())
