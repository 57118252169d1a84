#!/usr/bin/env bash
# Issue 9's device run: bench.trainer per backend (separate processes: each starts from an
# empty device and host), bench.weight_sync, the megatron save/load GPU test. Logs and JSON go
# to $OUT. Building a 4B trainer takes ~40-60 s before its first row (random init, megatron
# DDP/optimizer, ~64 GB of pinned offload buffers): budgets below leave rows ~50 s each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=$OUT/logs.txt
log() { echo "=== $(date -u +%H:%M:%S) $*" >>"$L"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$L" 2>&1
trainer() {  # backend, timeout s: rows start within timeout - 40 s; each row is written when measured
  mkdir -p /tmp/r/$1; log "bench.trainer $1"
  timeout $2 python3 -m bench.trainer --backends $1 --budget-s $(($2-40)) --out /tmp/r/$1 >>"$L" 2>&1; log "rc $?"
  cp /tmp/r/$1/bench_trainer.json $OUT/$1.json 2>/dev/null
}
trainer megatron 150
log "bench.weight_sync"; timeout 40 python3 -m bench.weight_sync --json $OUT/weight_sync.json >>"$L" 2>&1; log "rc $?"
trainer torch 120
log "save/load test"; timeout 40 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_megatron_save_gpu.py >>"$L" 2>&1; log "rc $?"
trainer megatron-critic 110
