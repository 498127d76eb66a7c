#!/usr/bin/env bash
# Runs on the GPU machine (device tool): installs the carried wheels once, then one part of the GPU
# suite per argument, each with its own time limit, writing logs and JSON lines under $OUT.
#   bench/gpu_suite.sh tests engine train weights async_rl
#   bench/gpu_suite.sh swe & bench/gpu_suite.sh terminal & bench/gpu_suite.sh tests; wait
# Extra arguments per part: TESTS_ARGS (pytest selection), ENGINE_ARGS, TRAIN_ARGS, WEIGHTS_ARGS,
# ASYNC_ARGS, R3_ARGS, R3L_ARGS (bench/r3_learning.py), OFFLOAD_ARGS, QUANT_ARGS, PLAN_ARGS; RECIPE_STEPS for swe/terminal/grpo (the
# recipes/<part>_h200.toml runs) and RECIPE_ARGS_<PART> (more `--set k=v` for that recipe run, e.g.
# RECIPE_ARGS_SWE="--set sft.steps=400"); T_<PART> overrides a part's time limit in seconds.
# `bench/gpu_suite.sh pack` tars everything under $OUT but summary.txt into $OUT/all.tgz (the device
# tool brings back at most 8 files).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
SITE=/tmp/site
if mkdir /tmp/site.lock 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
    && touch $SITE/.installed || { echo "wheel install failed"; touch /tmp/site.failed; }
fi
for _ in $(seq 300); do [ -e $SITE/.installed ] || [ -e /tmp/site.failed ] && break; sleep 1; done
[ -e $SITE/.installed ] || exit 1
export PYTHONPATH=$SITE:$PWD PATH=$SITE/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt"
port=$((29600 + RANDOM % 2000))
for part in "$@"; do
  lim() { local v="T_${part^^}"; echo "${!v:-$1}"; }
  case "$part" in
    tests)    timeout $(lim 280) python3 -m pytest -q -p no:cacheprovider -o addopts="" ${TESTS_ARGS:-tests/gpu tests/algo/test_cuda.py} > "$OUT/tests.log" 2>&1 ;;
    engine)   timeout $(lim 300) python3 bench/engine.py ${ENGINE_ARGS:-} > "$OUT/engine.log" 2>&1 ;;
    train)    timeout $(lim 270) python3 bench/train.py ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1 ;;
    weights)  timeout $(lim 300) python3 bench/weights.py ${WEIGHTS_ARGS:---no-check} > "$OUT/weights.log" 2>&1 ;;
    r3)       timeout $(lim 240) python3 bench/r3.py --device cuda ${R3_ARGS:-} > "$OUT/r3.log" 2>&1 ;;
    offload)  timeout $(lim 240) python3 bench/offload.py ${OFFLOAD_ARGS:-} > "$OUT/offload.log" 2>&1 ;;
    quant)    timeout $(lim 120) python3 bench/quant.py --device cuda ${QUANT_ARGS:-} > "$OUT/quant.log" 2>&1 ;;
    r3_learning) timeout $(lim 560) python3 bench/r3_learning.py --log-dir "$OUT/r3_learning" ${R3L_ARGS:-} > "$OUT/r3_learning.log" 2>&1 ;;
    plan)     timeout $(lim 400) python3 bench/plan_calibrate.py --device cuda ${PLAN_ARGS:-} > "$OUT/plan.log" 2>&1 ;;
    async_rl) timeout $(lim 540) python3 bench/async_rl.py --device cuda --engine-device cuda:1 --steps ${ASYNC_STEPS:-10} --timeout-s 200 --log-dir "$OUT/async_logs" ${ASYNC_ARGS:---model small --max-staleness 2,3 --set train.compile=false} > "$OUT/async_rl.log" 2>&1 ;;
    swe|terminal|grpo)
      run="$OUT/runs/$part"; extra="RECIPE_ARGS_${part^^}"
      timeout $(lim 540) python3 -m miles.cli run "recipes/${part}_h200.toml" --set "run.output_dir=\"$run\"" \
        --set logging.progress=false --set "cluster.head_port=$port" --set "loop.num_steps=${RECIPE_STEPS:-20}" \
        ${!extra:-} > "$OUT/$part.log" 2>&1
      port=$((port + 50)) ;;
    pack)     cd "$OUT" && tar czf all.tgz --exclude=all.tgz --exclude=summary.txt --exclude=gpus.txt --exclude=checkpoints --exclude="*.safetensors" . ; exit 0 ;;
    *)        echo "unknown part $part" > "$OUT/$part.log"; false ;;
  esac
  rc=$?
  { echo "== $part rc=$rc"; grep -h '^{' "$OUT/$part.log" | tail -8 | cut -c1-1500; tail -${TAIL:-6} "$OUT/$part.log"; } >> "$OUT/summary.txt"
done
