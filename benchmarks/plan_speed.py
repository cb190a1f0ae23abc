"""How fast `tetrad plan` answers for 16,384 GPUs (full 4D search: every grid, micro-batch and
checkpointing choice, plus the classic TP x CP x PP x DP space).

The requirement: under 2 seconds on a 2-core machine. Each case is timed twice:

- ``cold``: a fresh ``python -m tetrad.plan.cli plan ...`` process, as a user runs it (interpreter
  start, imports, search, printing);
- ``warm``: the search alone in this process (best of 3).

Usage: ``python benchmarks/plan_speed.py [--repeat 3]``. Exits 1 if any cold run takes 2 s or
more.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tetrad.plan.machine.spec import get_machine
from tetrad.plan.model.presets import get_model
from tetrad.plan.search.plan import plan

GPUS = 16384
CASES = [
    # (model, machine, global batch, sequence length)
    ("gpt-320b", "frontier", 8192, 2048),
    ("gpt-640b", "frontier", 8192, 2048),
    ("gpt-80b", "frontier", 16384, 2048),
    ("gpt-5b", "frontier", 16384, 2048),
    ("llama-3.1-70b", "h200-node", 8192, 8192),
    ("llama-3.1-405b", "dgx-h100", 4096, 8192),
    ("llama-3.1-8b", "dgx-h100", 16384, 4096),
]
LIMIT_S = 2.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="warm repetitions (best is shown)")
    args = ap.parse_args()
    print(
        f"tetrad plan, {GPUS} GPUs, {os.cpu_count()} CPUs visible, Python {sys.version.split()[0]}"
    )
    head = (
        f"{'model':>15} {'machine':>10} {'batch':>6} {'seq':>5} {'grids':>6} "
        f"{'fitting':>8} {'timed':>6} {'classic':>8} {'warm s':>7} {'cold s':>7}  best"
    )
    print(head)
    print("-" * len(head))
    worst = 0.0
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    for model_name, machine_name, batch, seq in CASES:
        model, machine = get_model(model_name), get_machine(machine_name)
        warm = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = plan(model, machine, GPUS, batch, seq)
            warm = min(warm, time.perf_counter() - t0)
        cmd = [
            sys.executable,
            "-m",
            "tetrad.plan.cli",
            "plan",
            "--model",
            model_name,
            "--machine",
            machine_name,
            "--gpus",
            str(GPUS),
            "--global-batch",
            str(batch),
            "--seq-len",
            str(seq),
        ]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL)
        cold = time.perf_counter() - t0
        worst = max(worst, cold)
        s4 = res.stats["four_d"]
        best = res.rows[0]
        print(
            f"{model_name:>15} {machine_name:>10} {batch:>6} {seq:>5} {s4['valid_grids']:>6} "
            f"{s4['fitting']:>8} {s4['evaluated']:>6} {res.stats['classic']['configs']:>8} "
            f"{warm:>7.3f} {cold:>7.3f}  {best.label()} mb{best.micro_batch} "
            f"{'ckpt' if best.activation_checkpointing else ''} MFU {100 * best.mfu:.1f}%"
        )
    print(
        f"slowest cold run: {worst:.3f} s (limit {LIMIT_S} s): "
        f"{'OK' if worst < LIMIT_S else 'TOO SLOW'}"
    )
    return 0 if worst < LIMIT_S else 1


if __name__ == "__main__":
    sys.exit(main())
