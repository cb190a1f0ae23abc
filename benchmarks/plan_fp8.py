"""The planner's FP8 estimates beside bf16 (issue 49): for each case, ``tetrad plan --fp8 auto``'s
lines (the 4D space, classic not searched) and the step's breakdown for bf16's best
configuration and for the fastest FP8 one, under each recipe: step, compute, the block Linears'
GEMMs (casts included), the casts, the weights' Z all-gathers (all seconds, and exposed), the
amax all-reduces and all exposed communication, seconds per step.

Usage: ``python benchmarks/plan_fp8.py [--machine dgx-h100] [--seq-len 8192]``; the cases
(model, GPUs, global batch) are :data:`CASES`. Plain Python, no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from tetrad.plan.machine.description import get_machine  # noqa: E402
from tetrad.plan.search.fp8_choice import fp8_breakdown, plan_fp8_auto  # noqa: E402
from tetrad.spec.presets import get_model  # noqa: E402

CASES = (("llama-3.1-8b", 8, 64), ("llama-3.1-8b", 64, 256), ("llama-3-70b", 512, 1024))
"""(model, GPUs, global batch in samples)."""

COLUMNS = ("step", "compute", "linear_gemms", "casts", "z_gather", "z_gather_exposed", "amax")


def breakdown_lines(model, machine, row, seq: int, batch: int) -> list[str]:
    """One line per recipe of :func:`fp8_breakdown` on ``row``'s configuration."""
    if row.pipe > 1:
        return [f"  ({row.label()}: a pipeline row, no breakdown)"]
    got = fp8_breakdown(
        model,
        machine,
        tuple(row.grid),
        row.micro_batch,
        row.activation_checkpointing,
        seq,
        batch,
        orientation=row.orientation,
        shard_optimizer=row.shard_optimizer,
    )
    head = f"  {'recipe':<11}" + "".join(f"{c:>17}" for c in COLUMNS) + f"{'vs bf16':>9}"
    out = [f"  on {row.label()} mb{row.micro_batch} {row.activation_checkpointing}:", head]
    for recipe, terms in got.items():
        ratio = got["off"]["step"] / terms["step"]
        out.append(
            f"  {recipe:<11}" + "".join(f"{terms[c]:>17.3f}" for c in COLUMNS) + f"{ratio:>8.2f}x"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", default="dgx-h100")
    ap.add_argument("--seq-len", type=int, default=8192)
    args = ap.parse_args()
    machine = get_machine(args.machine)
    for name, gpus, batch in CASES:
        model = get_model(name)
        result, lines = plan_fp8_auto(
            model, machine, gpus, batch, args.seq_len, top=1, classic=False
        )
        print(f"{name} on {gpus} x {machine.name}, global batch {batch} x {args.seq_len}:")
        print("\n".join("  " + line for line in lines))
        from tetrad.plan.search.plan import plan

        bf16 = plan(model, machine, gpus, batch, args.seq_len, top=1, classic=False).rows[0]
        rows = [bf16]
        if result.inputs["fp8"] != "off":
            best = result.rows[0]
            if (best.label(), best.micro_batch, best.activation_checkpointing) != (
                bf16.label(),
                bf16.micro_batch,
                bf16.activation_checkpointing,
            ):
                rows.append(best)
        for row in rows:
            print("\n".join(breakdown_lines(model, machine, row, args.seq_len, batch)))
        print()


if __name__ == "__main__":
    main()
