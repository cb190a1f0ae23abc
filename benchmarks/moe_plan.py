"""Issue 46's planner questions: ``tetrad plan`` for four mixture-of-experts models, each
answered in a fresh process, with the winner of the 4D space (grid, expert axis, micro-batch,
checkpointing), its predicted step, tokens/s, TFLOP/s per GPU and breakdown (compute, exposed
all-to-all and expert-gradient sums, the other axes, the pipeline bubble), and the classic
(Megatron-style, EP x ETP=1 x EDP) best beside it.

Usage: ``PYTHONPATH=. python benchmarks/moe_plan.py [--machine dgx-h100] [--imbalance 1.0]``.
Exits 1 if a question takes 1 s or more of search, or has no fitting plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
QUESTIONS = (  # model, GPUs, global batch (sequences of 4,096 tokens)
    ("mixtral-8x7b", 64, 256),
    ("qwen3-30b-a3b", 8, 64),
    ("qwen3-235b-a22b", 256, 1024),
    ("deepseek-v3", 1024, 4096),
)
LIMIT_S = 1.0


def breakdown(row: dict) -> str:
    """Compute, exposed all-to-all (and expert gradient sums), other axes, bubble: seconds."""
    exposed = dict(row["exposed_comm_s"])
    a2a = exposed.pop("expert", 0.0) + exposed.pop("ep", 0.0)
    bubble = row["other_s"].get("pipeline_bubble", 0.0)
    others = ", ".join(f"{k} {v:.3f}" for k, v in exposed.items() if v >= 0.0005)
    return (
        f"compute {row['compute_s']:.2f} s, exposed all-to-all {a2a:.2f} s, "
        f"other axes {sum(exposed.values()):.2f} s ({others or '-'}), bubble {bubble:.2f} s"
    )


def expert_span(sizes: dict, ep: int) -> str:
    """The axes a 4D row's expert group spans: ``ep`` consecutive ranks of a stage, X first,
    then Y, Z, context and data (``z8``, ``y2 c4 d8``; ``d2`` on ``G_data = 8``: 2 of its
    ranks, the rest expert-data)."""
    parts, left = [], ep
    for axis in ("x", "y", "z", "context", "data"):
        g = sizes.get(axis, 1)
        if left == 1 or g == 1:
            continue
        take = min(g, left)
        parts.append(f"{axis[0]}{take}")
        left //= take
    return " ".join(parts) or "-"


def describe(row: dict, peak: float) -> str:
    """One line of a ranked row's JSON: where it runs, step, tokens/s, TFLOP/s per GPU (``peak``
    FLOP/s times its MFU), memory and :func:`breakdown`."""
    sizes = row["sizes"]
    grid = ",".join(str(v) for v in sizes.values())
    pipe = row.get("pipeline", {}).get("pipe", 1) if row["space"] == "4d" else 1
    where = (f"P={pipe} " if pipe > 1 else "") + grid
    tflops = row["mfu"] * peak / 1e12
    mem = row["memory"]
    ep = row.get("expert_parallel", 1)
    span = f" ({expert_span(sizes, ep)})" if row["space"] == "4d" and ep > 1 else ""
    return (
        f"{where} ep={ep}{span}"
        + (" so" if row.get("shard_optimizer") else "")
        + f" mb={row['micro_batch']} {row['activation_checkpointing']}: step "
        f"{row['step_s']:.2f} s, {row['tokens_per_s'] / 1e3:.1f}k tok/s, {tflops:.0f} "
        f"TFLOP/s/GPU (MFU {100 * row['mfu']:.1f}%), memory {mem['total_gib']:.1f} GiB "
        f"({100 * mem['fraction']:.0f}%); {breakdown(row)}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--imbalance", type=float, default=1.0)
    ap.add_argument(
        "--param-dtype",
        default="fp32",
        choices=("fp32", "bf16"),
        help="the weights' stored format tetrad's 4D space is searched with (bf16: fp32 masters)",
    )
    args = ap.parse_args()
    failed = False
    for model, gpus, batch in QUESTIONS:
        argv = [sys.executable, "-m", "tetrad.cli", "plan", "--model", model, "--machine"]
        argv += [args.machine, "--gpus", str(gpus), "--global-batch", str(batch)]
        argv += ["--seq-len", "4096", "--moe-imbalance", str(args.imbalance), "--json"]
        argv += ["--param-dtype", args.param_dtype]
        env = dict(os.environ, PYTHONPATH=ROOT)
        run = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
        if run.returncode:
            print(f"{model} on {gpus}: {run.stderr.strip()}")
            failed = True
            continue
        res = json.loads(run.stdout)
        seconds = res["stats"]["seconds"]
        peak = float(res["inputs"]["machine_summary"].split(", ")[-1].split()[0]) * 1e12
        where = f"{model} on {gpus} {args.machine} GPUs, batch {batch} x 4096"
        print(f"{where}: search {seconds:.2f} s")
        print("  4D:      " + describe(res["four_d"][0], peak))
        if res["classic"]:
            print("  classic: " + describe(res["classic"][0], peak))
        failed |= seconds >= LIMIT_S or not res["four_d"][0]["memory"]["fits"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
