"""Time from SIGTERM to exit of the demo job (the preemption cost tetrad's save-on-signal adds).

Per repeat: ``tetrad train`` with the demo's settings (``small`` model, grid 2,2,1,1: 4 CPU
ranks, 16 x 256 tokens per step) on a fresh run directory, in a session of its own; once the
first logging interval is written, SIGTERM to the launcher, as SLURM sends it. Measured: the
seconds from the signal to the launcher's exit (the step in flight finishes, its checkpoint is
saved synchronously, the workers and the launcher exit), the step it stopped at, the median
step time of the run, and the exit code (143 expected). Prints one row per repeat and the
medians. From the repository root (about a minute per repeat on 2 cores, the first one also
tokenizes the corpus unless it is cached)::

    python benchmarks/preemption.py [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(run_dir: Path) -> dict:
    """One launch, SIGTERM after the first logging interval: the figures of the module
    docstring."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--run-dir", str(run_dir), "--steps", "300"]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise RuntimeError(proc.communicate()[0])
        time.sleep(0.05)
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate()
    seconds = time.perf_counter() - t0
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    line = next((ln for ln in out.splitlines() if ln.startswith("tetrad: stopped by")), "")
    return {
        "signal_to_exit_s": seconds,
        "exit_code": proc.returncode,
        "stopped_at": rows[-1]["step"],
        "median_step_s": statistics.median(r["step_time_s"] for r in rows),
        "line": line,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", help="where the run directories go (default: a temporary folder)")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="tetrad_preemption_"))
    results = []
    print("| repeat | SIGTERM to exit | stopped at step | median step | exit code |")
    print("|---|---|---|---|---|")
    for i in range(args.repeats):
        r = one(root / f"run{i}")
        results.append(r)
        print(
            f"| {i + 1} | {r['signal_to_exit_s']:.2f} s | {r['stopped_at']} | "
            f"{r['median_step_s']:.3f} s | {r['exit_code']} |",
            flush=True,
        )
    med = statistics.median(r["signal_to_exit_s"] for r in results)
    step = statistics.median(r["median_step_s"] for r in results)
    print(f"\nmedian SIGTERM to exit {med:.2f} s (median step {step:.3f} s); {results[-1]['line']}")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
