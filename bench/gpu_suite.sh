#!/usr/bin/env bash
# Runs on the GPU machine (device tool): installs the carried wheels, then one part of the GPU
# suite per argument, each with its own time limit, writing logs and JSON lines under $OUT.
#   bench/gpu_suite.sh tests engine train weights async_rl
# Extra arguments per part: TESTS_ARGS (pytest selection), ENGINE_ARGS, TRAIN_ARGS, WEIGHTS_ARGS,
# ASYNC_ARGS.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt"
for part in "$@"; do
  case "$part" in
    tests)    timeout ${T_TESTS:-280} python3 -m pytest -q -p no:cacheprovider -o addopts="" ${TESTS_ARGS:-tests/gpu tests/algo/test_cuda.py} 2>&1 | tail -${TESTS_TAIL:-60} > "$OUT/tests.log" ;;
    engine)   timeout ${T_ENGINE:-300} python3 bench/engine.py ${ENGINE_ARGS:-} 2>&1 | tee "$OUT/engine.log" | grep '^{' > "$OUT/engine.jsonl" ;;
    train)    timeout ${T_TRAIN:-270} python3 bench/train.py ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log" | grep '^{' > "$OUT/train.jsonl" ;;
    weights)  timeout ${T_WEIGHTS:-300} python3 bench/weights.py ${WEIGHTS_ARGS:---no-check} 2>&1 | tee "$OUT/weights.log" | grep '^{' > "$OUT/weights.jsonl" ;;
    async_rl) timeout ${T_ASYNC:-540} python3 bench/async_rl.py --device cuda --engine-device cuda:1 --steps ${ASYNC_STEPS:-10} --timeout-s 200 --log-dir "$OUT/async_logs" ${ASYNC_ARGS:---model small --max-staleness 2,3 --set train.compile=false} 2>&1 | tee "$OUT/async_rl.log" | grep '^{' > "$OUT/async_rl.jsonl" ;;
  esac
  echo "== $part rc=$?"; tail -5 "$OUT/$part.log" 2>/dev/null
done
