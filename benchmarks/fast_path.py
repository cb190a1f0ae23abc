"""Tokens/s of the demo job, eager vs ``--compile`` (and optionally an earlier checkout, or
other grids), side by side.

Runs ``tetrad train`` on the demo's model and grid for each variant, interleaved and repeated,
and reads each run's ``metrics.jsonl``: the median tokens/s and MFU over the steps after the
first logging interval (which holds torch.compile's compilation). Prints one table with ratios
to the first variant.

    python benchmarks/fast_path.py [--steps 16] [--repeats 2] [--baseline DIR] [--no-compile]
        [--grid G_DATA,G_Z,G_Y,G_X ...]

Several ``--grid`` values make each grid a variant (how the demo's grid was chosen:
``--no-compile --grid 2,2,1,1 2,1,2,1 2,1,1,2 1,2,2,1 1,2,1,2 1,1,2,2``).

``--baseline DIR`` adds an eager run of another checkout of tetrad (for example
``git worktree add /tmp/base <commit>``), run with ``PYTHONPATH=DIR``. CPU figures on a small
machine are time-sliced across ranks; compare only rows of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(src: Path, grid: str, extra: list[str], args: argparse.Namespace, run_dir: Path) -> dict:
    """One ``tetrad train`` run from the checkout ``src``: medians of ``tokens_per_s`` and
    ``mfu`` over the steps after the first ``--log-every`` interval."""
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--model", args.model]
    cmd += ["--grid", grid, "--steps", str(args.steps), "--run-dir", str(run_dir)]
    cmd += ["--log-every", str(args.log_every), "--val-every", "100000", *extra]
    # cwd=src: ``python -m`` puts the working directory first on sys.path, ahead of PYTHONPATH
    # and of an editable install, so each variant runs its own checkout's tetrad.
    env = os.environ | {"PYTHONPATH": str(src)}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=src)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = rows[args.log_every :]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
        "mfu": statistics.median(r["mfu"] for r in rows),
        "loss": rows[-1]["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--grid", nargs="+", default=["2,2,1,1"], help="one or more grids")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--log-every", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline", type=Path, help="another tetrad checkout to run eager")
    p.add_argument("--no-compile", action="store_true", help="leave out the --compile variant")
    args = p.parse_args()
    variants: dict[str, tuple[Path, str, list[str]]] = {}
    for grid in args.grid:
        tag = f" {grid}" if len(args.grid) > 1 else ""
        if args.baseline:
            variants[f"baseline eager{tag}"] = (args.baseline, grid, [])
        variants[f"eager{tag}"] = (REPO, grid, [])
        if not args.no_compile:
            variants[f"compile{tag}"] = (REPO, grid, ["--compile"])
    got: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (name, (src, grid, extra)) in enumerate(variants.items()):
                run_dir = Path(tmp) / f"v{i}_{rep}"
                got[name].append(run(src, grid, extra, args, run_dir))
                print(f"  {name} #{rep}: {got[name][-1]}", file=sys.stderr, flush=True)
    first = statistics.median(r["tokens_per_s"] for r in next(iter(got.values())))
    grids = " ".join(args.grid)
    print(f"model {args.model}, grid {grids}, {args.steps} steps x {args.repeats} repeats")
    print(f"{'variant':<24} {'tokens/s':>9} {'ratio':>6} {'MFU':>6} {'final loss':>10}")
    for name, runs in got.items():
        tok = statistics.median(r["tokens_per_s"] for r in runs)
        mfu = statistics.median(r["mfu"] for r in runs)
        print(
            f"{name:<24} {tok:>9,.0f} {tok / first:>6.3f} {100 * mfu:>5.1f}% "
            f"{runs[-1]['loss']:>10.4f}"
        )


if __name__ == "__main__":
    main()
