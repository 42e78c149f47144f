#!/usr/bin/env bash
# Everything this project needs from a GPU session, in one device call of at most ~9.5 minutes
# (the lease is 15 minutes including start-up; one call may run 10). Steps in priority order, each
# with its own time limit, all under one deadline: a slow step costs only what comes after it.
#
#   1. GPU correctness: tests/kernels/test_ops_gpu.py (CUDA graphs + compile first, every route, every config)
#   2. benchmarks/gpu_kernels.py --quick: per-layer timings of every route vs cuBLAS and cuSPARSELt
#   3. benchmarks/generate.py: dense vs 2:4 generation on the 8B shape at batch 1 (the end-to-end target)
#   4. benchmarks/train_step.py --model llama-1b: masked vs frozen dense training step, one sequence per step
#
#   bash benchmarks/gpu_session.sh        # on the device; results land in $OUT (or benchmarks/results/gpu)
#
# Record the numbers in benchmarks/RESULTS.md with the card, versions and date (env.txt has them).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python3}"
DEADLINE=$((SECONDS + ${GPU_SESSION_SECONDS:-560}))

step() {  # step NAME LIMIT_S CMD...: run under min(LIMIT_S, time left), log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS - 15))
    if ((left < 30)); then
        echo "== $name: skipped, ${left} s left before the deadline" | tee -a "$OUT/steps.txt"
        return
    fi
    ((limit > left)) && limit=$left
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
    tail -n 25 "$OUT/$name.log"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no CUDA device visible to $PY: nothing to measure" | tee -a "$OUT/steps.txt"
    exit 3
fi

TIMEOUT_FLAG=()
"$PY" -c "import pytest_timeout" 2> /dev/null && TIMEOUT_FLAG=(--timeout 90)
step test_kernels_gpu 200 "$PY" -m pytest -q -rs -p no:cacheprovider "${TIMEOUT_FLAG[@]}" tests/kernels/test_ops_gpu.py
grep -q "skipped" "$OUT/test_kernels_gpu.log" && echo "== test_kernels_gpu: SOME TESTS WERE SKIPPED" | tee -a "$OUT/steps.txt"
step kernels 170 "$PY" benchmarks/gpu_kernels.py --quick --out "$OUT/gpu_kernels.md"
step generate 200 "$PY" benchmarks/generate.py --models 8b --batches 1 --new-tokens 128 --budget-s 30 \
    --out "$OUT/generate.md"
step train_step 120 "$PY" benchmarks/train_step.py --model llama-1b --device cuda --bf16 --shapes 1x4096 --micro-batches 1 \
    --modes dense,masked --repeats 3
cat "$OUT/steps.txt"
