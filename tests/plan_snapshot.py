"""The planner's answers on a fixed set of questions, for the ranking snapshot test.

The planner must model the runtime exactly, so a change that makes it faster or moves its code
must not change a single answer (a change of the model itself takes the snapshot again, and its
commit says what moved). :func:`compute` asks the planner's public functions a fixed set
of questions and returns the answers as plain JSON data; ``tests/data/plan_snapshot.json.gz``
holds the answers of the code before such a change, and ``tests/test_plan_snapshot.py``
recomputes and compares them (same top-K order, seconds to 1e-9 relative, bytes exact).

The questions, for 6 models x 4 machines x 3 GPU counts (:data:`MODELS`, :data:`MACHINES`,
:data:`GPU_COUNTS`; global batch ``2 * GPUs``, :data:`SEQ_LEN` tokens):

- ``configs``: for 3 grids spread over the valid (data, context, Z, Y, X) grids, 2 micro-batches
  and the checkpointing modes ``none``, ``selective`` (or ``selective:K``, alternating) and
  ``full``, each under one of :data:`OVERLAP_CHOICES` in turn (every 5th in fp32): the step
  estimate (:func:`tetrad.plan.step_time.estimate`: step, compute and recompute seconds,
  exposed and all communication seconds per axis, micro-batches, the ``fine`` chunk count) and
  the memory estimate (:func:`tetrad.plan.memory.runtime.runtime_memory`: each phase's bytes, the
  peak phase and its components); plus one grid under every overlap choice; every 8th also the
  per-axis totals of the detailed collectives (:func:`tetrad.plan.comm.listing.axis_totals`).
- ``plans``: the ranked top 5 of :func:`tetrad.plan.search.plan.plan` (4D and classic rows, or the
  error message), with the default options, and per question one variant in turn: no overlap,
  AxoNN's communication model, one checkpointing mode, allowed micro-batches, fp32, a smaller
  memory.
- ``large``: the issue's question at scale, gpt-80b on Perlmutter with a global batch of 16,384
  on 4,096 and 16,384 GPUs, top 10 (:data:`LARGE`).
- ``pipeline``: the default question of every (model, machine) at one GPU count in turn, and
  the large ones, with the pipeline axis in the 4D space and interleaving and uneven splits in
  the classic one (:data:`WITH_PIPELINE`, the planner's defaults since issue 32's search got
  fast), top 5 and 10: taken with the search before its group, grid and memory floors, which
  must leave every row where it was.
- ``sublayers``: the T3 sublayer table (:func:`tetrad.plan.comm.sublayers.sublayers`; the fused
  ring's replay) per model and machine at TP 2, 4 and 8.

Seconds are stored with 12 significant digits (the test compares to 1e-9), bytes exactly.

Write the file (only for a deliberate change of the model, with the reason in the commit)::

    PYTHONPATH=. python tests/plan_snapshot.py --write
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

from tetrad.plan.comm.listing import axis_totals
from tetrad.plan.comm.sublayers import sublayers
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import get_machine
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.plan import plan
from tetrad.plan.search.space import divisors, factorizations
from tetrad.plan.step_time import estimate
from tetrad.spec.presets import get_model
from tetrad.spec.sharding import context_problems, grid_problems

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "plan_snapshot.json.gz")
MODELS = ("gpt-5b", "gpt-20b", "gpt-80b", "llama-1b", "llama-3.1-8b", "llama-2-70b")
MACHINES = ("perlmutter", "frontier", "dgx-h100", "t3-sim")
GPU_COUNTS = (64, 256, 1024)
SEQ_LEN = 2048
OVERLAP_CHOICES = (
    "all",
    "none",
    "prefetch",
    "reduce_scatter",
    "dx_all_reduce",
    "dp_all_reduce",
    "domino",
    "fine",
    "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino",
    "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino,fine",
)
"""Every single overlap, none, all (``fine`` where it pays), all but ``fine`` (the runtime's
default) and all six named (``fine`` forced)."""
TOP = 5


def seconds(v: float) -> float:
    """``v`` rounded to 12 significant digits (the test compares to 1e-9 relative)."""
    return float(f"{v:.12g}")


def exact(v: float) -> float | int:
    """``v`` as an int when it is whole (bytes), else the float itself."""
    return int(v) if float(v).is_integer() else float(v)


def _spread(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (first and last included)."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


def _grids(model, gpus: int, batch: int) -> list[tuple[int, ...]]:
    """The valid five-size grids of ``gpus`` that split the batch, context grids included."""
    out = []
    for g in factorizations(gpus, 5):
        if grid_problems(model, g) or context_problems(SEQ_LEN, g[1]) or batch % (g[0] * g[2]):
            continue
        out.append(g)
    return out


def _per_axis(d: dict) -> dict:
    """Nonzero seconds per key (the classic rows' ``stage_layers`` as they are)."""
    return {k: seconds(v) if isinstance(v, float) else v for k, v in d.items() if v}


def _config(model, machine, grid, b: int, ckpt: str, overlaps: str, fp32: bool, detail: bool):
    batch = 2 * _gpus(grid)
    ctx = StepQuestion(
        model, machine, SEQ_LEN, batch, overlaps=overlaps, compute_bytes=4 if fp32 else 2
    )
    est = estimate(ctx, grid, b, ckpt, detail=detail)
    ov = ctx.overlaps
    mem = runtime_memory(
        model,
        grid,
        b,
        SEQ_LEN,
        machine.memory_bytes,
        activation_checkpointing=ckpt,
        dtype="fp32" if fp32 else "bf16",
        prefetch="prefetch" in ov,
        async_reduce_scatter="reduce_scatter" in ov,
        dp_overlap="dp_all_reduce" in ov,
    )
    out = {
        "model": model.name,
        "machine": machine.name,
        "grid": list(grid),
        "micro_batch": b,
        "checkpointing": ckpt,
        "overlaps": overlaps,
        "fp32": fp32,
        "step_s": seconds(est.step_s),
        "compute_s": seconds(est.compute_s),
        "recompute_s": seconds(est.recompute_s),
        "exposed_s": _per_axis(est.exposed_s),
        "comm_s": _per_axis(est.comm_s),
        "grad_accum": est.grad_accum,
        "fine_chunks": est.fine_chunks,
        "memory_phases": {k: exact(v) for k, v in mem.phases.items()},
        "memory_peak": mem.peak_phase,
        "memory_components": {k: exact(v) for k, v in mem.components.items() if v},
    }
    if detail:
        out["axis_totals"] = {
            ax: {k: (seconds(v) if k.endswith("_s") else exact(v)) for k, v in t.items()}
            for ax, t in sorted(axis_totals(est.collectives).items())
        }
    return out


def _gpus(grid) -> int:
    n = 1
    for g in grid:
        n *= g
    return n


def _configs(model, machine, gpus: int, counter: list[int]) -> list[dict]:
    batch = 2 * gpus
    grids = _spread(_grids(model, gpus, batch), 3)
    out = []
    for gi, grid in enumerate(grids):
        per_cell = batch // (grid[0] * grid[2])
        sizes = divisors(per_cell)
        for b in dict.fromkeys((1, sizes[min(2, len(sizes) - 1)])):
            sel = "selective" if (gi + b) % 2 else f"selective:{max(1, model.n_layers // 2)}"
            for ckpt in ("none", sel, "full"):
                n = counter[0]
                counter[0] += 1
                ov = OVERLAP_CHOICES[n % len(OVERLAP_CHOICES)]
                out.append(_config(model, machine, grid, b, ckpt, ov, n % 5 == 4, n % 8 == 0))
    if grids:
        grid = grids[len(grids) // 2]
        for ov in OVERLAP_CHOICES:
            out.append(_config(model, machine, grid, 1, "full", ov, False, False))
    return out


def _row(r) -> dict:
    return {
        "label": r.label(),
        "micro_batch": r.micro_batch,
        "checkpointing": r.activation_checkpointing,
        "grad_accum": r.grad_accum,
        "step_s": seconds(r.step_s),
        "compute_s": seconds(r.compute_s),
        "recompute_s": seconds(r.recompute_s),
        "exposed_s": _per_axis(r.exposed_s),
        "other_s": _per_axis(r.other_s),
        "mfu": seconds(r.mfu),
        "memory_total": exact(r.memory.total),
    }


VARIANTS = (
    ("overlaps none", {"overlaps": "none"}),
    ("axonn", {"comm_model": "axonn"}),
    ("checkpointing full", {"checkpointing": ("full",)}),
    ("checkpointing selective", {"checkpointing": ("selective",)}),
    ("micro-batches 1,2", {"micro_batches": (1, 2)}),
    ("fp32", {"dtype": "fp32", "classic": False}),
    ("24 GiB", {"gpu_memory_bytes": 24 * 2**30}),
    ("overlaps fine", {"overlaps": "fine"}),
)
"""Variants of the default question, one per (model, machine, GPU count) in turn."""
LARGE = (("gpt-80b", "perlmutter", 4096, 16384), ("gpt-80b", "perlmutter", 16384, 16384))
"""``(model, machine, GPUs, global batch)`` of the large questions (top 10)."""


NO_PIPELINE = {"pipeline": False, "classic_pipeline": False}
"""The parts ``plans`` and ``large`` are of the spaces without the pipeline axis (issue 32):
the 5D search and the classic space with 1F1B on even splits only; with the axis, rows without
a pipeline are the same (tests/test_plan_pipeline.py)."""
WITH_PIPELINE = {"pipeline": True, "classic_pipeline": True}
"""The part ``pipeline``: both spaces with their pipeline options (the defaults)."""


def _plan(
    model,
    machine,
    gpus: int,
    name: str,
    options: dict,
    batch: int = 0,
    top: int = TOP,
    spaces: dict = NO_PIPELINE,
) -> dict:
    out: dict = {"model": model.name, "machine": machine.name, "gpus": gpus, "variant": name}
    try:
        res = plan(model, machine, gpus, batch or 2 * gpus, SEQ_LEN, top=top, **spaces, **options)
    except PlanError as e:
        out["error"] = str(e)
        return out
    out["four_d"] = [_row(r) for r in res.rows]
    out["classic"] = [_row(r) for r in res.classic]
    return out


def _sublayers(model, machine) -> list[dict]:
    try:
        rows = sublayers(model, machine, (2, 4, 8), SEQ_LEN)
    except PlanError as e:
        return [{"error": str(e)}]
    return [
        {
            "name": r.name,
            "tp": r.tp,
            "chunks": r.chunks,
            **{k: seconds(getattr(r, k)) for k in ("gemm", "collective", "fused", "ideal")},
        }
        for r in rows
    ]


def compute(progress: bool = False) -> dict:
    """Every answer of the snapshot (module doc), as JSON-ready data."""
    configs, plans, subs, piped = [], [], [], []
    counter, k = [0], 0
    for model_name in MODELS:
        model = get_model(model_name)
        for machine_name in MACHINES:
            machine = get_machine(machine_name)
            rows = _sublayers(model, machine)
            subs.append({"model": model_name, "machine": machine_name, "rows": rows})
            for gpus in GPU_COUNTS:
                t0 = time.perf_counter()
                configs += _configs(model, machine, gpus, counter)
                plans.append(_plan(model, machine, gpus, "default", {}))
                name, options = VARIANTS[k % len(VARIANTS)]
                k += 1
                plans.append(_plan(model, machine, gpus, name, options))
                if gpus == GPU_COUNTS[len(subs) % len(GPU_COUNTS)]:
                    piped.append(_plan(model, machine, gpus, "default", {}, spaces=WITH_PIPELINE))
                if progress:
                    dt = time.perf_counter() - t0
                    print(f"{model_name} {machine_name} {gpus}: {dt:.2f} s", file=sys.stderr)
    large = [
        _plan(get_model(mo), get_machine(ma), gpus, "large", {}, batch, 10)
        for mo, ma, gpus, batch in LARGE
    ]
    piped += [
        _plan(get_model(mo), get_machine(ma), gpus, "large", {}, batch, 10, WITH_PIPELINE)
        for mo, ma, gpus, batch in LARGE
    ]
    return {
        "configs": configs,
        "plans": plans,
        "large": large,
        "sublayers": subs,
        "pipeline": piped,
    }


def load() -> dict:
    """The stored snapshot."""
    with gzip.open(PATH, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {PATH}")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data = compute(progress=True)
    n = len(data["configs"])
    print(f"{n} configurations, {len(data['plans'])} plans in {time.perf_counter() - t0:.1f} s")
    if args.write:
        os.makedirs(os.path.dirname(PATH), exist_ok=True)
        text = json.dumps(data, separators=(",", ":"), sort_keys=True)
        with gzip.GzipFile(PATH, "wb", mtime=0) as fh:  # mtime 0: the same bytes every time
            fh.write(text.encode("utf-8"))
        print(f"wrote {PATH} ({os.path.getsize(PATH)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
