"""The planner's overlap model against the runtime: predicted vs measured communication time,
exposed communication and step time, per axis, with overlap off and on.

The planner's overlap model (:func:`tetrad.plan.step_time.collectives`) walks the same
schedule the runtime runs (tetrad/parallel/overlap.py). This script

1. calibrates this machine: ``tetrad calibrate --nproc 4`` writes a machine
   TOML (skipped with ``--machine FILE``);
2. runs ``tetrad train`` (CPU, gloo, 4 ranks) on a fixed model for grids 1,2,1,2 and 2,1,2,1,
   alternating ``--overlap none`` and ``--overlap all``, with ``--log-every 1`` (the trainer
   times whole logging intervals, so only then is each row one step's time), and reads each
   run's ``metrics.jsonl`` (rank 0's per-axis ``comm_time_s`` and ``comm_exposed_s``, and
   ``step_time_s``): the means of steps 2..N, the first step, which records the prefetch
   order, left out (``benchmarks/overlap.py``'s ``run``, which checks there is one row per
   step);
3. asks the planner for the same configuration on the calibrated machine (the runtime's model
   sizes from ``RUN_DIR/config.json``, fp32 compute, no activation checkpointing) and prints one
   table: per axis measured vs predicted communication and exposed time, then measured vs
   predicted step time and compute (step minus exposed communication), with ratios
   predicted / measured.

    python benchmarks/overlap_model.py [--machine FILE] [--quick-calibration] [--steps 6]
                                       [--repeats 1] [--model small] [--seq-len 256]

On a 2-core machine the 4 ranks are time-sliced, so compute, gloo's transport threads and the
other ranks compete for the cores; the calibration measures that contended machine and the
prediction stays rough. gloo has no reduce-scatter: the runtime issues an all-reduce (twice the
ring traffic) where the planner predicts a reduce-scatter, which the Z rows show. The figures are
printed as measured.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# benchmarks/overlap.py, beside this script
from overlap import add_run_options, describe
from overlap import run as train

from tetrad.plan.comm.listing import axis_totals
from tetrad.plan.machine.description import get_machine
from tetrad.plan.machine.network import ALL_REDUCE, REDUCE_SCATTER
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import collectives, estimate
from tetrad.spec.grid import COMM_AXES
from tetrad.spec.model import ModelSpec

GRIDS = ("1,2,1,2", "2,1,2,1")


def calibrate_machine(path: Path, quick: bool) -> None:
    """Write a machine TOML for this machine with 4 CPU ranks (``tetrad calibrate``)."""
    cmd = [
        sys.executable,
        "-m",
        "tetrad.cli",
        "calibrate",
        "--device",
        "cpu",
        "--nproc",
        "4",
        "--out",
        str(path),
    ] + (["--quick"] if quick else [])
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    print(done.stdout.rstrip())


def planner_model(mc: dict) -> ModelSpec:
    """The planner's description of the runtime's Llama (``RUN_DIR/config.json`` sizes)."""
    return ModelSpec(**mc)


def predict(
    model: ModelSpec,
    machine,
    grid: tuple[int, int, int, int],
    overlap: str,
    args: argparse.Namespace,
) -> dict:
    """The planner's step time, compute and per-axis communication / exposed seconds; and
    ``z_gloo``: the Z communication with each reduce-scatter timed as the all-reduce gloo runs."""
    cols = collectives(
        model,
        machine,
        grid,
        args.micro_batch,
        args.seq_len,
        args.global_batch,
        overlaps=overlap,
        compute_bytes=4,
    )
    per_axis = axis_totals(cols)
    ctx = StepQuestion(
        model, machine, args.seq_len, args.global_batch, overlaps=overlap, compute_bytes=4
    )
    est = estimate(ctx, grid, args.micro_batch, False)
    lz = machine.network.grid_links(grid)["z"]
    z_gloo = sum(
        c.calls * (lz.time(ALL_REDUCE, c.payload_bytes) if c.kind == REDUCE_SCATTER else c.time_s)
        for c in cols
        if c.axis == "z"
    )
    return {
        "step": est.step_s,
        "compute": est.compute_s,
        "z_gloo": z_gloo,
        "comm": {a: per_axis.get(a, {}).get("time_s", 0.0) for a in COMM_AXES},
        "exposed": {a: per_axis.get(a, {}).get("exposed_s", 0.0) for a in COMM_AXES},
    }


def _ratio(pred: float, meas: float) -> str:
    return f"{pred / meas:.2f}" if meas > 0 else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--machine", help="machine TOML to use instead of calibrating")
    p.add_argument("--quick-calibration", action="store_true", help="calibrate with --quick")
    add_run_options(p, steps=6, repeats=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.machine) if args.machine else Path(tmp) / "calibrated.toml"
        if not args.machine:
            calibrate_machine(path, args.quick_calibration)
        machine = get_machine(str(path))
        net = machine.network
        print(
            f"machine {path.name}: peak {machine.peak_flops / 1e9:.3g} GFLOP/s per rank, "
            f"memory {machine.hbm_bytes_per_s / 1e9:.3g} GB/s, bandwidth "
            + ", ".join(f"G={g} stride={s} {bw:.3g} GB/s" for s, g, bw in net.intra_table)
            + f", latency {net.latency_base_us:.3g} us + {net.latency_hop_intra_us:.3g} us "
            "per ring step"
        )
        print(describe(args) + " (per grid)")
        head = (
            f"{'grid':>8} {'overlap':>7} {'axis':>6} | {'comm ms':>8} {'pred':>8} "
            f"{'p/m':>5} | {'exposed ms':>10} {'pred':>8} {'p/m':>5}"
        )
        print(head)
        print("-" * len(head))
        for grid in GRIDS:
            res: dict[str, list[dict]] = {"none": [], "all": []}
            for i in range(args.repeats):
                for overlap in ("none", "all"):
                    out = Path(tmp) / f"{grid.replace(',', '')}-{i}-{overlap}"
                    res[overlap].append(train(grid, overlap, args, out))
            sizes = tuple(int(v) for v in grid.split(","))
            model = planner_model(res["none"][0]["model_config"])
            for overlap in ("none", "all"):
                runs = res[overlap]
                meas = {
                    "step": statistics.mean(r["step"] for r in runs),
                    "comm": {a: statistics.mean(r["comm"][a] for r in runs) for a in COMM_AXES},
                    "exposed": {
                        a: statistics.mean(r["exposed"][a] for r in runs) for a in COMM_AXES
                    },
                }
                pred = predict(model, machine, sizes, overlap, args)
                for a in COMM_AXES:
                    mc, pc = meas["comm"][a], pred["comm"][a]
                    me, pe = meas["exposed"][a], pred["exposed"][a]
                    if not (mc or pc):
                        continue
                    print(
                        f"{grid:>8} {overlap:>7} {a:>6} | {mc * 1e3:>8.1f} {pc * 1e3:>8.1f} "
                        f"{_ratio(pc, mc):>5} | {me * 1e3:>10.1f} {pe * 1e3:>8.1f} "
                        f"{_ratio(pe, me):>5}"
                    )
                if pred["comm"]["z"]:
                    print(
                        f"{grid:>8} {overlap:>7} {'z*':>6} | {'':>8} "
                        f"{pred['z_gloo'] * 1e3:>8.1f} "
                        f"{_ratio(pred['z_gloo'], meas['comm']['z']):>5} |"
                    )
                m_exp = sum(meas["exposed"].values())
                m_comp = meas["step"] - m_exp
                print(
                    f"{grid:>8} {overlap:>7} {'step':>6} | {meas['step'] * 1e3:>8.1f} "
                    f"{pred['step'] * 1e3:>8.1f} {_ratio(pred['step'], meas['step']):>5} | "
                    f"{m_comp * 1e3:>10.1f} {pred['compute'] * 1e3:>8.1f} "
                    f"{_ratio(pred['compute'], m_comp):>5}"
                )
        print(
            "z* rows: predicted Z communication with each reduce-scatter timed as the "
            "all-reduce that gloo runs instead"
        )
        print(
            "step rows: step time in the comm columns; compute (measured: step minus all "
            "exposed communication; predicted: the planner's compute) in the exposed columns"
        )


if __name__ == "__main__":
    main()
