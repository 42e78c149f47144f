#!/usr/bin/env bash
# Everything this project needs from a GPU session, prepared so that two device calls do it all
# (each well under the 10-minute call limit; the whole lease is 15 minutes including start-up).
#
#   part 1 (<= 9 min): GPU correctness (tests/test_kernels_gpu.py), then benchmarks/kernels.py --quick
#   part 2 (<= 9 min): benchmarks/generate.py on the 8B shape at batch 1 (the end-to-end target), then
#                    the masked training step vs the frozen dense step (issue 6's GPU ratio)
#
#   bash benchmarks/gpu_session.sh 1      # on the device: results land in $OUT (or benchmarks/results/gpu)
#   bash benchmarks/gpu_session.sh 2
#
# Every step has its own timeout and writes its log as it goes, so a slow step costs only itself.
# Record the numbers in benchmarks/RESULTS.md with the card, versions and date (env.txt has them).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python3}"
PART="${1:-1}"

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, print the tail
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --signal=INT --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
    tail -n 30 "$OUT/$name.log"
}

{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

case "$PART" in
1)
    step test_kernels_gpu 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py
    step kernels 270 "$PY" benchmarks/kernels.py --quick --out "$OUT/kernels.md"
    ;;
2)
    step generate 330 "$PY" benchmarks/generate.py --models 8b --batches 1 --new-tokens 256 \
        --budget-s 60 --out "$OUT/generate.md"
    step train_step 200 "$PY" benchmarks/train_step.py --model llama-1b --device cuda --bf16 --shapes 1x4096 \
        --modes dense,masked --repeats 3
    ;;
*)
    echo "usage: $0 1|2" >&2
    exit 2
    ;;
esac
