"""bf16 against FP8 (``--fp8 tensorwise`` and ``rowwise``) in one invocation: the same model,
data, seed and steps, one ``tetrad train`` per recipe, and for each its tokens/s and step time
(medians after the first logging interval), peak memory, the last loss and how far it is from
bf16's, beside the planner's predicted step ratio (issue 49's GPU check).

    python benchmarks/fp8.py --model llama-1b --seq-len 4096 --micro-batch 8 --steps 200 \\
        --compile --machine h200-node --out runs/fp8        # one GPU (carry the torchao wheel)
    python benchmarks/fp8.py --device cpu --model tiny --steps 6     # smoke test, emulated FP8

Writes ``OUT/fp8.md`` and ``OUT/fp8.json``; each run's log is ``OUT/train_RECIPE.log``. The
planner's ratio is ``tetrad plan``'s step for the grid 1,1,1,1 and micro-batch (bf16 over the
recipe's), on ``--machine`` (none without one).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu.common import run_logged, say  # noqa: E402
from benchmarks.gpu.training import summarize_metrics  # noqa: E402
from tetrad.train.metrics import read_rows  # noqa: E402

RECIPES = ("off", "tensorwise", "rowwise")


def command(args: argparse.Namespace, recipe: str, run_dir: Path) -> list[str]:
    """The ``tetrad train`` command of one recipe's run."""
    cmd = [sys.executable, "-m", "tetrad.cli", "train", "--model", args.model]
    cmd += ["--device", args.device, "--grid", "1,1,1,1", "--fp8", recipe]
    cmd += ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    cmd += ["--global-batch", str(args.micro_batch), "--steps", str(args.steps)]
    cmd += ["--activation-checkpointing", args.activation_checkpointing]
    cmd += ["--log-every", str(args.log_every), "--val-every", str(10 * args.steps)]
    cmd += ["--checkpoint-every", "0", "--no-resume", "--run-dir", str(run_dir)]
    return cmd + (["--compile"] if args.compile else [])


def predicted_ratio(args: argparse.Namespace, recipe: str) -> float | None:
    """bf16's predicted step over ``recipe``'s on ``--machine`` (None without one)."""
    if not args.machine or recipe == "off":
        return None
    from tetrad.plan.machine.description import get_machine
    from tetrad.plan.question import StepQuestion
    from tetrad.plan.step_time import estimate
    from tetrad.spec.presets import get_model

    model, machine = get_model(args.model), get_machine(args.machine)
    steps = []
    for r in ("off", recipe):
        q = StepQuestion(model, machine, args.seq_len, args.micro_batch, fp8=r)
        steps.append(
            estimate(q, (1, 1, 1, 1), args.micro_batch, args.activation_checkpointing).step_s
        )
    return steps[0] / steps[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--activation-checkpointing", default="selective")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--machine", default="", help="the planner's machine for its ratio")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--out", default="runs/fp8")
    args = ap.parse_args()
    if args.device == "cpu":  # the tiny smoke test
        args.seq_len, args.micro_batch, args.log_every = min(args.seq_len, 64), 2, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for recipe in args.recipes.split(","):
        run_dir, log = out / f"run_{recipe}", out / f"train_{recipe}.log"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = command(args, recipe, run_dir)
        say(f"fp8 {recipe}: {shlex.join(cmd)}")
        t0 = time.monotonic()
        rc, wall = run_logged(cmd, log, args.timeout_s)
        res = {"command": shlex.join(cmd), "rc": rc, "wall_s": wall, "log": str(log)}
        metrics = run_dir / "metrics.jsonl"
        if rc == 0 and metrics.is_file():
            rows, _ = read_rows(metrics)
            res |= summarize_metrics(rows, args.log_every)
            res["predicted_ratio"] = predicted_ratio(args, recipe)
        results[recipe] = res
        say(f"fp8 {recipe}: exit {rc} after {time.monotonic() - t0:.0f} s")
    base = results.get("off", {})
    lines = [
        f"`{shlex.join(sys.argv)}`",
        "",
        "| recipe | tokens/s | step s | vs bf16 | planner's | peak GiB | last loss | vs bf16's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for recipe, r in results.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {recipe} | failed: exit {r['rc']} (see {r['log']}) | | | | | | |")
            continue
        speed = base.get("step_time_s", 0) / r["step_time_s"] if "step_time_s" in base else None
        loss = r["final_loss"] / base["final_loss"] - 1 if "final_loss" in base else None
        pred = r.get("predicted_ratio")
        lines.append(
            f"| {recipe} | {r['tokens_per_s']:,.0f} | {r['step_time_s']:.4f} | "
            f"{f'{speed:.3f}x' if speed else '-'} | {f'{pred:.3f}x' if pred else '-'} | "
            f"{r['peak_memory_bytes'] / 2**30:.2f} | {r['final_loss']:.4f} | "
            f"{f'{loss:+.2%}' if loss is not None else '-'} |"
        )
    (out / "fp8.md").write_text("\n".join(lines) + "\n")
    (out / "fp8.json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0 if all("tokens_per_s" in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
