"""Overlap off vs on: step time, communication time and exposed communication, side by side.

Runs ``tetrad train`` (CPU, gloo) on a fixed model for 4 and 8 processes, alternating
``--overlap none`` and ``--overlap all`` runs, and reads each run's ``metrics.jsonl`` (the first
step, which records the prefetch order, is skipped). Prints one table; ratios are on/off.

    python benchmarks/overlap.py [--steps 8] [--repeats 2] [--model small] [--seq-len 256]

On a 2-core machine 4 or 8 ranks are time-sliced, so compute and gloo's transport threads
compete for the same cores: the figures show what the code does, not what a GPU cluster gets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tetrad.spec.grid import COMM_AXES

GRIDS = {4: "1,2,1,2", 8: "1,2,2,2"}


def run(grid: str, overlap: str, args, run_dir: Path) -> dict:
    """One ``tetrad train`` run; means over steps 2.. of rank 0's metrics (seconds per step):
    ``step``, ``comm`` and ``exposed`` per axis, ``tok_s``, and the run's ``model_config``."""
    cmd = [
        sys.executable,
        "-m",
        "tetrad.cli",
        "train",
        "--grid",
        grid,
        "--overlap",
        overlap,
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
        "--global-batch",
        str(args.global_batch),
        "--micro-batch",
        str(args.micro_batch),
        "--run-dir",
        str(run_dir),
        "--val-every",
        "100000",
        "--log-every",
        "1",  # a row per measured step (the trainer times whole logging intervals)
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in rows] != list(range(1, args.steps + 1)):  # one timed row per step
        raise RuntimeError(f"{run_dir}: metrics.jsonl is not one row per step 1..{args.steps}")
    rows = rows[1:]  # step 1 records the prefetch order
    return {
        "step": statistics.mean(r["step_time_s"] for r in rows),
        "comm": {a: statistics.mean(r["comm_time_s"].get(a, 0.0) for r in rows) for a in COMM_AXES},
        "exposed": {
            a: statistics.mean(r["comm_exposed_s"].get(a, 0.0) for r in rows) for a in COMM_AXES
        },
        "tok_s": statistics.mean(r["tokens_per_s"] for r in rows),
        "model_config": json.loads((run_dir / "config.json").read_text())["model_config"],
    }


def totals(r: dict) -> dict:
    """``r`` with communication and exposed time summed over the axes."""
    return {
        "step": r["step"],
        "comm": sum(r["comm"].values()),
        "exposed": sum(r["exposed"].values()),
        "tok_s": r["tok_s"],
    }


def add_run_options(p: argparse.ArgumentParser, steps: int, repeats: int) -> None:
    """The options of one benchmarked ``tetrad train`` run, and how many off/on pairs."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--repeats", type=int, default=repeats, help="off/on pairs")
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)


def describe(args: argparse.Namespace) -> str:
    """One line saying what every benchmarked run is."""
    return (
        f"model {args.model}, {args.global_batch} x {args.seq_len} tokens/step, "
        f"micro-batch {args.micro_batch}, {args.steps} steps per run, {args.repeats} "
        f"alternating off/on pair(s); means of steps 2..{args.steps}, rank 0"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(p, steps=8, repeats=2)
    args = p.parse_args()
    print(describe(args))
    header = (
        f"{'ranks':>5} {'grid':>9} {'overlap':>8} {'step ms':>9} {'comm ms':>9} "
        f"{'exposed ms':>11} {'exposed %':>10} {'tokens/s':>9}"
    )
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for world, grid in GRIDS.items():
            res: dict[str, list[dict]] = {"none": [], "all": []}
            for i in range(args.repeats):
                for overlap in ("none", "all"):
                    out = Path(tmp) / f"{world}-{i}-{overlap}"
                    res[overlap].append(totals(run(grid, overlap, args, out)))
            mean = {
                o: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for o, rs in res.items()
            }
            for o in ("none", "all"):
                m = mean[o]
                print(
                    f"{world:>5} {grid:>9} {o:>8} {m['step'] * 1e3:>9.1f} "
                    f"{m['comm'] * 1e3:>9.1f} {m['exposed'] * 1e3:>11.1f} "
                    f"{100 * m['exposed'] / m['step']:>9.0f}% "
                    f"{m['tok_s']:>9.0f}"
                )
            off, on = mean["none"], mean["all"]
            print(
                f"{world:>5} {grid:>9} {'on/off':>8} {on['step'] / off['step']:>9.2f} "
                f"{on['comm'] / off['comm']:>9.2f} {on['exposed'] / off['exposed']:>11.2f} "
                f"{'':>10} {on['tok_s'] / off['tok_s']:>9.2f}"
            )


if __name__ == "__main__":
    main()
