#!/usr/bin/env bash
# One device call's worth of GPU checks (10 minutes at most), chosen by STEPS:
#   [STEPS="gpu_tests sglang_payload learning"] [ROLLOUTS=100] bash bench/device_pass.sh OUT_DIR [BUDGET_S]
# Carry `.whl` (megatron-core, pyzmq, torch_memory_saver) and, for sglang_payload, `.whl_sglang`
# (the sglang wheel and the small packages its sglang.srt.utils imports, all without deps).
#   host_pinning    bench.host_pinning beside a 48 GiB block held, and the host's NUMA/THP facts
#   gpu_tests       every test marked gpu (`bash .ci/gpu`)
#   sglang_payload  the weight payload test through sglang's real serializer and tensor bucket
#   weight_sync     bench.weight_sync (the production sync against a memcpy of the same bytes)
#   trainer         bench.trainer, megatron actor and critic, 8k packed tokens: MFU (median of 3)
#                   and steady-state offload/onload
#   learning        tiny_ppo with megatron trainers on the GPU, colocated, every weight sync
#                   verified bit for bit (the README's bar: +0.4, last five >= 0.7); gets what is left
# Each step has its own limit; logs and JSON go to OUT_DIR, packed into OUT_DIR/device_pass.tgz
# at the end (the device tool returns only a few files per call).
set -u
OUT=${1:?usage: bench/device_pass.sh OUT_DIR [BUDGET_S]}
BUDGET=${2:-560}
START=$SECONDS
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>&1
STEPS=${STEPS:-gpu_tests sglang_payload learning}
step() {  # NAME LIMIT_S CMD...: SIGINT at the limit (benches still print what they measured)
  local name=$1 limit=$2
  shift 2
  [[ " $STEPS " == *" $name "* ]] || return 0
  echo "== $(date -u +%H:%M:%S) $name (limit $limit s)"
  timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? after $((SECONDS - START)) s"
  tail -n 3 "$OUT/$name.log"
}
if [[ " $STEPS " == *" host_pinning "* ]]; then
  { nvidia-smi topo -m; lscpu | grep -i numa; free -g; cat /sys/kernel/mm/transparent_hugepage/enabled; } \
    > "$OUT/numa.txt" 2>&1
fi
step host_pinning 90 python3 -m bench.host_pinning --gib 8 --resident-gib 48
step gpu_tests 360 bash .ci/gpu
if [[ " $STEPS " == *" sglang_payload "* ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_sglang \
    .whl_sglang/*.whl || exit 1
fi
PYTHONPATH=/tmp/site_sglang:$PYTHONPATH step sglang_payload 120 \
  python3 -m pytest -m gpu -q -p no:cacheprovider -rs tests/test_rollout_sglang.py
step weight_sync 40 python3 -m bench.weight_sync --json "$OUT/weight_sync.json"
step trainer 230 python3 -m bench.trainer --backends megatron megatron-critic --tokens 8192 \
  --recompute 8192=none --budget-s 200 --out "$OUT/trainer"
step learning $((BUDGET - (SECONDS - START) - 5)) python3 launch.py --train-backend megatron --no-fake-gpus \
  --actor-num-gpus-per-node 1 --num-gpus-per-node 1 --num-rollout "${ROLLOUTS:-100}" --check-weight-update-equal \
  --run-dir /tmp/learning
cp /tmp/learning/metrics.jsonl "$OUT/learning_metrics.jsonl" 2>/dev/null
# which sync path the run took: weight_bucket spans record `direct`
grep -s 'weight_bucket' /tmp/learning/events.jsonl | grep -o '"direct": *[a-z]*' | sort | uniq -c \
  > "$OUT/learning_direct.txt" 2>&1
tar czf /tmp/device_pass.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/device_pass.tgz "$OUT/"
exit 0
