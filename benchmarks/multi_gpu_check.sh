#!/usr/bin/env bash
# Every parallel axis of tetrad over NCCL on one machine of 2, 4 or 8 GPUs, in one command:
#
#   benchmarks/multi_gpu_check.sh [OUT]          # OUT: default runs/multi_gpu_check
#
# For each case of benchmarks/multi_gpu_check.py's table for NGPU ranks, one
# `torchrun --standalone --nproc_per_node NGPU -m tetrad.cli train` of 4 steps of the `tiny`
# model (`moe-tiny` for the expert cases; global batch 8 x 32 tokens, micro-batch 1, bf16
# autocast) on a small generated corpus:
#   2 GPUs: data=2, context=2, z=2, y=2, x=2, pipe=2, data=2 with --shard-optimizer, y=2 with the
#           `fine` overlap (fused GEMM + reduce-scatter rings), data=2,expert=2 (moe-tiny);
#   4 GPUs: data=2,z=2; context=2,x=2; y=2,x=2; z=4; data=2,context=2 sharded; data=2,y=2 fine;
#           pipe=2,data=2; pipe=2,x=2; data=4,expert=4;
#   8 GPUs: z=2,y=2,x=2; data=2,context=2,z=2; data=2,y=2,x=2; data=4,z=2 sharded;
#           data=2,z=2,x=2 fine; pipe=2,data=2,y=2; pipe=2,z=2,x=2; data=8,expert=4.
# Each is checked against
#   - the reference: the same run on the grid 1,1,1,1 in one process (the weights and the data
#     order do not depend on the grid): every step's loss within 2e-2 relative (bf16; 1e-5 in
#     fp32 on the CPU);
#   - the planner's bytes, from step 2 on, on rank 0: every axis of a dense grid without a
#     pipeline equal to tetrad.plan's collectives (as tests/test_plan_validation.py does on gloo);
#     a pipeline's `pipe` axis equal to p2p_bytes per micro-batch plus the loss's all-reduce
#     (tests/test_pipeline.py); the other axes of a pipeline and an MoE grid's bytes (the
#     all-to-alls follow the routing) are only recorded in the report;
#   - that it ran: `fine` cases fused their rings every step, expert cases report routing.
# Over NCCL this exercises what no CPU test can: the grouped point-to-point of the `fine` rings
# and the pipeline stages, `device_id` binding, the sub-groups of every axis and their
# flattened data x context group, the sharded optimizer's reduce-scatter and all-gather, the
# expert all-to-alls, the exposed times from CUDA events (recorded, not judged).
#
# OUT receives multi_gpu_check.md (one row per case: grid, ranks, options, largest loss
# difference, bytes check, verdict, seconds, then the problems and the bytes per axis),
# multi_gpu_check.json and logs/CASE.log (each run's output). Exit status 0 when every case
# passes, 1 otherwise (a case skipped for lack of time included). Not yet timed on GPUs:
# expected about 20 s per case (the torchrun, import and NCCL start dominate; the steps are
# milliseconds), so 10 runs (the cases and two references) in under 8 minutes. BUDGET_S
# (default 450 s; 1800 on the CPU) ends the check: no case starts later, one still running
# then is stopped and fails.
#
# Settings: NGPU (default: the GPUs `nvidia-smi -L` lists; 2 on the CPU), DEVICE=cuda|cpu
# (cpu: the smoke mode, gloo and fp32 on the CPU, 2 steps), ONLY=name,name (a subset of the
# cases, by the names of the table), PY (default python3).
set -u
OUT=${1:-runs/multi_gpu_check}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-$([ "$DEVICE" = cpu ] && echo 1800 || echo 450)}
if [ -z "${NGPU:-}" ]; then
    if [ "$DEVICE" = cpu ]; then
        NGPU=2
    else
        NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    fi
fi
case "$NGPU" in
2 | 4 | 8) ;;
*)
    echo "multi_gpu_check: NGPU=$NGPU: this check runs on 2, 4 or 8 GPUs (set NGPU to one of them)"
    exit 2
    ;;
esac
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rm -rf "$OUT/runs" "$OUT/logs"  # no run of an earlier check is judged as this one's
exec "$PY" -m benchmarks.multi_gpu_check --out "$OUT" --device "$DEVICE" --nproc "$NGPU" \
    --only "${ONLY:-}" --budget-s "$BUDGET_S"
