#!/usr/bin/env bash
# qwen3_4b_ppo_1gpu (qwen3_4b_ppo scaled to one GPU), measured by bench.iteration (docs/benchmarks.md).
#
#   [RECIPE=qwen3_4b_ppo_1gpu PLANS="ppo grpo" PPO_ROLLOUTS=3 GRPO_ROLLOUTS=2 GRPO_S=130 RESPONSE_LEN=2048 EVAL=0 RM=0 ASYNC=0 SIDE=0] \
#     bash bench/qwen3_4b_one_gpu.sh OUT_DIR [BUDGET_S]
#
# EVAL=1 adds the eval of ppo.generate.evaluation: 256 prompts the run does not train on x 4 samples at
# RESPONSE_LEN tokens, after every EVAL_INTERVAL-th rollout (default 2: the second rollout, whose
# graphs are captured, so its rollout tokens/s is the steady one the eval's is compared with;
# an eval takes ~230 s at 2048 tokens, one per 10-minute call), never before training; it skips
# step 1 to leave the time to it. `EVAL=1 PLANS=grpo GRPO_ROLLOUTS=2` fits one device call.
#
# 1. A tiny random-init Qwen3 through the same path (megatron trainers, built-in engine, the
#    same recipe and plan): one rollout with both updates and the weight sync, or the script
#    stops there. Skipped when BUDGET_S < 520.
# 2. An untrained Qwen3-4B (ppo.make_model, random init) and generated dapo-math prompts.
# 3. PPO: both trainers keep their bf16 weights on the GPU and move only their optimizers
#    (float32 main params and Adam moments, 45 GiB each) to pinned host memory and back
#    around their train calls; the engine keeps its weights and KV cache.
# 4. GRPO (no critic): the actor and the engine both stay resident, nothing moves.
# RM=1: every run also scores with a reward model on the same GPU (--reward-model-path, an
#    untrained qwen3-4b-rm written like the policy; the tiny run a qwen3-tiny-rm), which onloads
#    its bf16 weights after the engine's turn and offloads them before the actor's; the table
#    gets its reward_model phase and scoring tokens/s.
#    `RM=1 PLANS=ppo GRPO_S=0 PPO_ROLLOUTS=2 bash bench/qwen3_4b_one_gpu.sh OUT 500` fits one call.
# RESPONSE_LEN above 2048 (8192): the KV cache of 64 such responses (~75 GiB) fits only while
# the trainers hold just their weights, so the engine takes 62% of the GPU and frees its KV
# cache (and graphs) around the trainers' calls, and the GRPO actor moves its optimizer too.
# Measured 2026-12-03: one iteration 293 s (PPO) / 202 s (GRPO), so one device call (10 min)
# holds start-up and one iteration of either (docs/benchmarks.md).
# RECIPE=qwen3_4b_ppo_1gpu_80gb: the 80 GB GPU's plan (H100): the engine frees its weights and KV
#    cache after generating, each trainer moves its weights and optimizer around its calls.
# Every step is time-limited; whatever ran is analysed. OUT_DIR gets the logs, each run's
# analysis (NAME_iteration.json) and event log; the run directories stay in /tmp/runs.
set -u
OUT=${1:?usage: bench/qwen3_4b_one_gpu.sh OUT_DIR [BUDGET_S]}
BUDGET=${2:-570}
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
mkdir -p "$OUT"
CK=/tmp/qwen3-4b-random
TINY=/tmp/qwen3-tiny-random
{ nvidia-smi; free -g; df -hT /tmp; python3 -c "import torch, psutil; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1

# The recipe carries the one-GPU layout and the 2048-token memory plan (ppo/config/recipes.py); the
# bench only saves nothing, prints plain lines and varies the plan.
COMMON=(--recipe "${RECIPE:-qwen3_4b_ppo_1gpu}" --load none --save none --save-interval none --log-format plain)
LEN=${RESPONSE_LEN:-2048}
if [ "$LEN" -le 2048 ]; then
  PPO_PLAN=()
  GRPO_PLAN=(--advantage-estimator grpo --no-offload-train --offload-train-level all)
else
  PPO_PLAN=(--offload-rollout --offload-rollout-level kv_cache --sglang-mem-fraction-static 0.62)
  GRPO_PLAN=(--advantage-estimator grpo "${PPO_PLAN[@]}")
fi
# ASYNC=1 (2 GPUs: the nvidia-h200-x2 kind; 2048 tokens): the same plans with --train-async, the
# trainers on GPU 0 and the engine alone on GPU 1 (SIDE=1 is the one-GPU async plan), so the
# next rollout generates while the step trains; ppo.generate.rollout_ahead. Its steady steps (the second
# on) against a run without it show the overlap; bench.iteration prints the engine's time
# generating within each step.
if [ "${ASYNC:-0}" = 1 ]; then
  ASYNC_PLAN=(--train-async --no-colocate --num-gpus-per-node 2 --actor-num-gpus-per-node 1 --rollout-num-gpus 1)
  PPO_PLAN+=("${ASYNC_PLAN[@]}")
  GRPO_PLAN+=("${ASYNC_PLAN[@]}")
fi

# SIDE=1 (one GPU, 2048 tokens; one plan a call: PLANS=ppo or PLANS=grpo): the plan runs twice
# in the call, as above (synchronous, colocated) and side by side (--train-async: the engine and
# the trainers resident at once, each in its memory budget, the SMs shared under MPS, by default
# 100/100 with the trainers at below_normal priority: ppo.gpu.side_by_side), that one analysed
# --against the first, so its table ends with the ratio of their steady iterations (goal: GRPO
# <= 0.7x, PPO <= 0.8x; measured: GRPO 0.91x, docs/benchmarks.md). The rollouts default to 3
# (steady: step 1). `SIDE=1 PLANS=grpo bash bench/qwen3_4b_one_gpu.sh OUT 570` fits one call.
# SIDE_VARIANTS="FLAGS;FLAGS": one side-by-side run for each ';'-separated set of extra flags
# (e.g. "--engine-sm-percentage 50 --trainer-sm-percentage 50 --trainer-mps-priority normal"),
# each against the same synchronous run: GRPO's sync and two side-by-side runs fit one call.
if [ "${SIDE:-0}" = 1 ] && [ "${PLANS:-}" != ppo ] && [ "${PLANS:-}" != grpo ]; then
  echo "SIDE=1 runs one plan a call: add PLANS=ppo or PLANS=grpo" >&2
  exit 2
fi

step() {  # NAME SECONDS CMD...: run CMD under a limit (SIGINT first: bench.iteration still reports)
  local name=$1 limit=$2
  shift 2
  timeout -s INT -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc after $((SECONDS - START)) s (limit $limit s)"
  tail -n 4 "$OUT/$name.log"
  return $rc
}
keep() {  # NAME: bring back the run's analysis and event log only (few files come back)
  cp "$RUNS/$1/iteration.json" "$OUT/$1_iteration.json" 2>/dev/null
  cp "$RUNS/$1/run/events.jsonl" "$OUT/$1_events.jsonl" 2>/dev/null
}
RUNS=/tmp/runs

TINY_RM=() RM_ARGS=()
if [ "${RM:-0}" = 1 ]; then
  step rm_checkpoint 75 python3 -m ppo.make_model --arch qwen3-4b-rm --device cuda --num-prompts 256 \
    /tmp/qwen3-4b-rm-random || exit 1
  RM_ARGS=(--reward-model-path /tmp/qwen3-4b-rm-random)
fi

if [ "$BUDGET" -ge 520 ] && [ "${EVAL:-0}" != 1 ] && [ "${SIDE:-0}" != 1 ]; then  # below that the two full-size runs need all of it
step tiny_checkpoint 45 python3 -m ppo.make_model --arch qwen3-4b --device cuda --num-prompts 256 \
  --override num_hidden_layers=2 --override hidden_size=256 --override intermediate_size=512 \
  --override num_attention_heads=4 --override num_key_value_heads=2 --override head_dim=64 "$TINY" || exit 1
if [ "${RM:-0}" = 1 ]; then
  step tiny_rm_checkpoint 45 python3 -m ppo.make_model --arch qwen3-tiny-rm --num-prompts 64 \
    "$TINY-rm" || exit 1
  TINY_RM=(--reward-model-path "$TINY-rm")
fi
step tiny 120 python3 -m bench.iteration --out "$RUNS/tiny" -- "${COMMON[@]}" "${PPO_PLAN[@]}" "${TINY_RM[@]}" \
  --hf-checkpoint "$TINY" --prompt-data "$TINY/dapo_math_prompts.jsonl" --num-rollout 1 \
  --num-critic-only-steps 0 --rollout-max-response-len 32 --sglang-mem-fraction-static 0.1 \
  --run-dir "$RUNS/tiny/run" || { keep tiny; exit 1; }
fi

step checkpoint 75 python3 -m ppo.make_model --arch qwen3-4b --device cuda --num-prompts 768 "$CK" || exit 1
head -n 512 "$CK/dapo_math_prompts.jsonl" > "$CK/train_prompts.jsonl"
FULL=(--hf-checkpoint "$CK" --prompt-data "$CK/train_prompts.jsonl" --rollout-max-response-len "$LEN"
      --num-critic-only-steps 0 "${RM_ARGS[@]}")
if [ "${EVAL:-0}" = 1 ]; then  # the other 256 prompts are the eval set
  tail -n 256 "$CK/dapo_math_prompts.jsonl" > "$CK/eval_prompts.jsonl"
  FULL+=(--eval-prompt-data dapo_eval "$CK/eval_prompts.jsonl" --eval-interval "${EVAL_INTERVAL:-2}"
         --skip-eval-before-train --n-samples-per-eval-prompt 4 --eval-max-response-len "$LEN")
fi
if [ "${SIDE:-0}" = 1 ]; then
  if [ "$PLANS" = ppo ]; then PLAN=("${PPO_PLAN[@]}"); else PLAN=("${GRPO_PLAN[@]}"); fi
  N=${SIDE_ROLLOUTS:-3}
  IFS=';' read -r -a VARIANTS <<< "${SIDE_VARIANTS:-}"
  ((${#VARIANTS[@]})) || VARIANTS=("")
  RUNS_LEFT=$((${#VARIANTS[@]} + 1))
  step "$PLANS" $(( ($(left) - 5) / RUNS_LEFT )) python3 -m bench.iteration --out "$RUNS/$PLANS" -- "${COMMON[@]}" \
    "${PLAN[@]}" "${FULL[@]}" --num-rollout "$N" --run-dir "$RUNS/$PLANS/run"
  keep "$PLANS"
  for i in "${!VARIANTS[@]}"; do
    RUNS_LEFT=$((RUNS_LEFT - 1))
    NAME="${PLANS}_side${i#0}"
    read -r -a EXTRA <<< "${VARIANTS[$i]}"
    step "$NAME" $(( ($(left) - 5) / RUNS_LEFT )) python3 -m bench.iteration --out "$RUNS/$NAME" \
      --against "$RUNS/$PLANS" -- "${COMMON[@]}" "${PLAN[@]}" --train-async "${EXTRA[@]}" "${FULL[@]}" \
      --num-rollout "$N" --run-dir "$RUNS/$NAME/run"
    keep "$NAME"
    echo "== $NAME (${VARIANTS[$i]:-the default shares}):"
    grep -h "side by side\|steady iteration" "$OUT/$NAME.log"
  done
  exit 0
fi
if [ "${PLANS:-ppo grpo}" != grpo ]; then
  step ppo $(( $(left) - ${GRPO_S:-130} )) python3 -m bench.iteration --out "$RUNS/ppo" -- "${COMMON[@]}" \
    "${PPO_PLAN[@]}" "${FULL[@]}" --num-rollout "${PPO_ROLLOUTS:-3}" --run-dir "$RUNS/ppo/run"
  keep ppo
fi
[ "${PLANS:-ppo grpo}" != ppo ] && [ "$(left)" -ge 90 ] || exit 0
step grpo $(( $(left) - 5 )) python3 -m bench.iteration --out "$RUNS/grpo" -- "${COMMON[@]}" "${GRPO_PLAN[@]}" \
  "${FULL[@]}" --num-rollout "${GRPO_ROLLOUTS:-2}" --run-dir "$RUNS/grpo/run"
keep grpo
exit 0
