#!/usr/bin/env bash
# Every GPU check of one device lease, in order, under one deadline (TOTAL_S, default 555 s:
# one call of a 15-minute lease on one H200, its start and a short rerun left over):
#
#   benchmarks/gpu_all.sh OUT
#
# 1. gpu_check.py (at most 300 s): equivalence, llama-1b bf16 seq 2048 eager and --compile at
#    the largest micro-batch the planner fits (steps 17-18 profiled), memory and step time vs
#    the planner;
# 2. gpu_memory.py formats (at most 150 s): llama-1b seq 2048 x 16 with fp32 and bf16 weights and
#    the residual stream in the compute dtype (auto) or fp32, eager, then compiled with fp32
#    weights and either stream (the sixth lease found the bf16 stream's compiled step slower:
#    the norm fix a52f9a3 is measured here): measured peak and step time vs `tetrad memory
#    --param-dtype --residual-dtype`;
# 3. vs_transformers.py (at most 240 s, its rounds stopping 30 s before): tetrad against
#    transformers' LlamaForCausalLM, llama-1b eager and compiled, seq 2048 x 16 and 4096 x 8;
# 4. gpu_memory.py --cases 8b,1b (at most 140 s; only with 60 s left): Llama-3.1-8B seq 4096 on
#    one GPU first (its start-to-first-step time included), then llama-1b's recompute modes,
#    measured peak vs `tetrad memory`;
# 5. gloo_cuda.py (at most 60 s; only with 30 s left): two ranks sharing the GPU over gloo.
# An item that would start with too little time left is skipped with a line. Each item runs
# under `timeout` (SIGTERM: gpu_check kills its training run on the way out, vs_transformers
# and gpu_memory keep the reports they write as they go), then SIGKILL 15 s later.
#
# OUT receives 8 files at most (what the device returns): gpu_all.log (this script's whole
# output: versions, each item's progress and exit status, gloo_cuda's lines), gpu_check.md,
# gpu_check.json, train.log (gpu_check's two training logs), vs_transformers.md,
# vs_transformers.json, gpu_memory.md, gpu_memory.json (the formats' tables and rows first, then
# item 4's).
# DEVICE=cpu runs the same as a smoke test (tiny sizes).
set -u
OUT=${1:-runs/gpu_all}
WORK=${WORK:-/tmp/gpu_all}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
TOTAL_S=${TOTAL_S:-555}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TETRAD_CACHE="$WORK/cache"
LOG="$OUT/gpu_all.log"
: > "$LOG"

say() {
    echo "== $* ($(date +%T), ${SECONDS} s of ${TOTAL_S})" | tee -a "$LOG"
}

# budget NAME MAX_S MIN_S: LIMIT = the smaller of MAX_S and the seconds left; fails (and says
# so) when fewer than MIN_S are left.
budget() {
    local left=$((TOTAL_S - SECONDS))
    if [ "$left" -lt "$3" ]; then
        say "$1 skipped: $left s left, it needs $3"
        return 1
    fi
    LIMIT=$((left < $2 ? left : $2))
    say "$1 (time limit $LIMIT s)"
}

# run NAME CMD...: CMD under the time limit LIMIT, its output into the log.
run() {
    local name=$1
    shift
    timeout -k 15 "$LIMIT" "$@" 2>&1 | tee -a "$LOG"
    say "$name exit status ${PIPESTATUS[0]}"
}

collect() {
    for f in gc/gpu_check.md gc/gpu_check.json vt/vs_transformers.md vt/vs_transformers.json; do
        [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
    done
    # the gpu_memory runs' tables in one file and their rows in one list (8 files come back)
    cat "$WORK"/gmf*/gpu_memory.md "$WORK"/gm/gpu_memory.md > "$OUT/gpu_memory.md" 2>/dev/null
    $PY -c 'import json, os, sys
print(json.dumps([r for f in sys.argv[1:] if os.path.exists(f) for r in json.load(open(f))]))' \
        "$WORK"/gmf*/gpu_memory.json "$WORK"/gm/gpu_memory.json > "$OUT/gpu_memory.json" 2>/dev/null
    [ -s "$OUT/gpu_memory.md" ] || rm -f "$OUT/gpu_memory.md" "$OUT/gpu_memory.json"
    for f in "$WORK"/gc/train_eager.log "$WORK"/gc/train_compile.log; do
        [ -f "$f" ] && { echo "==== $(basename "$f")"; cat "$f"; }
    done > "$OUT/train.log"
    [ -s "$OUT/train.log" ] || rm -f "$OUT/train.log"
}
trap collect EXIT

# Wheels carried in .whl (tetrad's pure-Python dependencies the GPU image lacks, e.g. tomli_w:
# see the device notes) are installed first, outside the image's packages.
if ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" .whl/*.whl && export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
    $PY -c "import transformers; print('transformers', transformers.__version__)"
} 2>&1 | tee -a "$LOG"
rm -rf "$WORK/gc" "$WORK/vt" "$WORK/gm" "$WORK"/gmf*  # no earlier run's report is copied
cases=8b,1b small=1b formats_mb=16
[ "$DEVICE" = cpu ] && cases=tiny small=tiny formats_mb=2

if budget gpu_check 300 60; then
    run gpu_check $PY benchmarks/gpu_check.py --device "$DEVICE" --out "$WORK/gc"
fi
if budget gpu_memory_formats 150 60; then
    run gpu_memory_formats $PY benchmarks/gpu_memory.py --device "$DEVICE" --cases "$small" \
        --micro-batches "$formats_mb" --modes none --param-dtypes fp32,bf16 \
        --residual-dtypes auto,fp32 --out "$WORK/gmf1"
fi
if budget gpu_memory_formats_compiled 110 60; then
    run gpu_memory_formats_compiled $PY benchmarks/gpu_memory.py --device "$DEVICE" \
        --cases "$small" --micro-batches "$formats_mb" --modes none --param-dtypes fp32 \
        --residual-dtypes auto,fp32 --compile --out "$WORK/gmf2"
fi
if budget vs_transformers 240 90; then
    run vs_transformers $PY benchmarks/vs_transformers.py --device "$DEVICE" --out "$WORK/vt" \
        --budget-s $((LIMIT - 30))
fi
if budget gpu_memory 140 60; then
    run gpu_memory $PY benchmarks/gpu_memory.py --device "$DEVICE" --cases "$cases" \
        --out "$WORK/gm"
fi
if budget gloo_cuda 60 30; then
    run gloo_cuda $PY benchmarks/gloo_cuda.py --device "$DEVICE"
fi
say "done"
