#!/usr/bin/env bash
# Every GPU check of one device lease, in order, each under its own time limit:
#
#   benchmarks/gpu_all.sh OUT        (about 7 minutes on one H100/H200; at most 9.5)
#
# 1. gpu_check.py: equivalence, llama-1b bf16 seq 2048 eager and --compile at the largest
#    micro-batch the planner fits (steps 17-18 profiled), memory and step time vs the planner;
# 2. gpu_memory.py: measured peak vs `tetrad memory` per recompute mode and micro-batch, and
#    Llama-3.1-8B seq 4096 on one GPU;
# 3. gloo_cuda.py: two ranks sharing the GPU over gloo, equivalence on four grids.
# Copies the reports (8 files at most) into OUT. DEVICE=cpu runs the same as a smoke test.
set -u
OUT=${1:-runs/gpu_all}
WORK=${WORK:-/tmp/gpu_all}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TETRAD_CACHE="$WORK/cache"
collect() {
    for f in gc/gpu_check.md gc/gpu_check.json gc/train_eager.log gc/train_compile.log \
        gm/gpu_memory.md gm/gpu_memory.json; do
        [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
    done
}
trap collect EXIT
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
cases=1b,8b
[ "$DEVICE" = cpu ] && cases=tiny
echo "== gpu_check $(date +%T)"
timeout 360 $PY benchmarks/gpu_check.py --device "$DEVICE" --out "$WORK/gc"
echo "== gpu_check rc $? $(date +%T)"
timeout 140 $PY benchmarks/gpu_memory.py --device "$DEVICE" --cases "$cases" --out "$WORK/gm"
echo "== gpu_memory rc $? $(date +%T)"
timeout 60 $PY benchmarks/gloo_cuda.py --device "$DEVICE" 2>&1 | tee "$OUT/gloo_cuda.txt"
echo "== gloo_cuda done $(date +%T)"
