"""Part (b) of ``benchmarks/gpu_check.py``: ``python -m tetrad.cli train`` eager and with
``--compile`` on the grid 1,1,1,1, each in its own session with its output logged, and the
medians of its ``metrics.jsonl`` (tokens/s, MFU, step seconds, peak memory bytes)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

from tetrad.train.metrics import read_rows

from .common import GRID, run_logged, say
from .profiles import Profile


def train_command(args: argparse.Namespace, prof: Profile, mb: int, run_dir: Path) -> list[str]:
    """The ``tetrad train`` command line of one run (eager; append ``--compile``)."""
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--model", args.model]
    cmd += ["--device", args.device, "--grid", ",".join(map(str, GRID))]
    cmd += ["--seq-len", str(args.seq_len), "--micro-batch", str(mb), "--global-batch", str(2 * mb)]
    cmd += ["--steps", str(args.steps), "--warmup-steps", str(min(prof.warmup, args.steps))]
    cmd += ["--log-every", str(prof.log_every), "--val-every", str(max(1000, args.steps))]
    a, b = prof.profile_steps
    if b < args.steps:  # a profiled window before the last step (which validates and saves)
        cmd += ["--profile-steps", f"{a}:{b}"]
    cmd += [
        "--val-batches",
        "1",
        "--checkpoint-every",
        "0",
        "--no-resume",
        "--run-dir",
        str(run_dir),
    ]
    for path in prof.data:
        cmd += ["--data", path]
    if prof.bpe_vocab:
        cmd += ["--vocab-size", str(prof.bpe_vocab)]
    return cmd


def summarize_metrics(rows: list[dict], log_every: int) -> dict:
    """Medians over the steps after the first logging interval (all steps if there are no
    others): ``tokens_per_s``, ``mfu`` (fraction), ``step_time_s`` (s); the peak memory (bytes),
    the first interval's seconds (torch.compile's compilation included) and the last losses."""
    after = [r for r in rows if r["step"] > log_every] or rows
    first = [r for r in rows if r["step"] <= log_every]

    def median(key: str) -> float:
        return statistics.median(r[key] for r in after)

    return {
        "steps_logged": len(rows),
        "steps_in_median": len(after),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "step_time_s": median("step_time_s"),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        "first_interval_s": sum(r["step_time_s"] for r in first),
        "final_loss": rows[-1]["loss"],
        "val_loss": rows[-1].get("val_loss"),
    }


def train_run(args: argparse.Namespace, prof: Profile, name: str, mb: int, deadline: float) -> dict:
    """One training run (``name``: ``eager`` or ``compile``): its command, exit status, log,
    the lines about torch.compile and the MFU peak, and :func:`summarize_metrics`."""
    out = Path(args.out)
    run_dir, log = out / f"run_{name}", out / f"train_{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = train_command(args, prof, mb, run_dir) + (["--compile"] if name == "compile" else [])
    res: dict = {"command": shlex.join(cmd), "micro_batch": mb, "log": str(log), "ok": False}
    timeout = min(prof.run_timeout_s, deadline - time.monotonic())
    if timeout < 30:
        return res | {"error": "skipped: the time budget is spent"}
    say(f"(b) training {name}, micro-batch {mb} (log {log})")
    rc, wall = run_logged(cmd, log, timeout)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    text = log.read_text(errors="replace")
    lines = text.splitlines()
    res |= {"rc": rc, "wall_s": wall, "oom": "out of memory" in text.lower()}
    res["compile_line"] = next((ln for ln in lines if "tetrad: torch.compile:" in ln), None)
    res["mfu_peak_line"] = next((ln for ln in lines if "tetrad: MFU against" in ln), None)
    summaries = sorted(run_dir.glob("trace_steps_*.txt"))
    res["profile"] = summaries[0].read_text() if summaries else None
    for trace in run_dir.glob("trace_steps_*.json"):
        trace.unlink()  # hundreds of MB; the summary above is what the report keeps
    metrics = run_dir / "metrics.jsonl"
    if rc != 0 or not metrics.is_file():
        why = "timed out" if rc is None else f"exit status {rc}"
        return res | {"error": f"{why}: " + " | ".join(lines[-8:])}
    rows, _ = read_rows(metrics)
    return res | {"ok": bool(rows)} | (summarize_metrics(rows, prof.log_every) if rows else {})


def training_part(args: argparse.Namespace, prof: Profile, mb: int, deadline: float) -> dict:
    """Eager then compiled runs; an eager run out of memory is retried with half the
    micro-batch (the compiled run then uses that one)."""
    eager = train_run(args, prof, "eager", mb, deadline)
    retried = []
    while not eager["ok"] and eager.get("oom") and mb > 1:
        retried.append(mb)
        mb //= 2
        say(f"(b) out of memory: retrying with micro-batch {mb}")
        eager = train_run(args, prof, "eager", mb, deadline)
    compiled = train_run(args, prof, "compile", mb, deadline)
    return {
        "micro_batch": mb,
        "out_of_memory_at": retried,
        "runs": {"eager": eager, "compile": compiled},
    }
