"""Every parallel axis of ``tetrad train`` on 2, 4 or 8 ranks against the one-process reference
and the planner's bytes (``benchmarks/multi_gpu_check.sh`` runs it; its header says what it
checks on GPUs).

For each case of :data:`CASES` (a grid of ``--nproc`` ranks and its options), one
``torchrun --standalone --nproc_per_node N -m tetrad.cli train`` of a few steps of a tiny model on
a small generated corpus, then:

- **losses**: each step's loss of ``metrics.jsonl`` against the same run on the grid
  ``1,1,1,1`` (one process; tetrad's initial weights and the data order do not depend on the
  grid), largest relative difference within :data:`benchmarks.gpu.equivalence.TOLERANCES`'s
  ``loss_rel`` (bf16 on CUDA, fp32 on CPU);
- **bytes**: from the second step on (the first also records the prefetch order and lays out
  the buckets), rank 0's bytes per axis (``comm_bytes``, ring bytes sent) against the planner:
  every axis of a dense grid without a pipeline equals
  :func:`tetrad.plan.comm.listing.axis_totals` of :func:`tetrad.plan.step_time.collectives`
  (the set of axes too); a pipeline's ``pipe`` axis equals
  :func:`tetrad.plan.pipe.schedule.p2p_bytes` per micro-batch and send plus the loss's
  all-reduce over the stages, its other axes are only recorded; an MoE grid's bytes are only
  recorded (the all-to-alls follow the routing, which the planner takes as uniform);
- **ran**: a ``fine`` case ran the fused rings (``overlaps_ran.fine_fused`` > 0), an expert case
  reports routing figures.

Writes ``OUT/multi_gpu_check.md`` (one row per case), ``OUT/multi_gpu_check.json`` and each
run's log under ``OUT/logs``; exits 1 if any case fails or is skipped for lack of time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ALL_OVERLAPS = "prefetch,reduce_scatter,dx_all_reduce,dp_all_reduce,domino,fine,context"
"""``--overlap`` naming every overlap: ``fine`` named is on without a machine description."""

DENSE, MOE = "tiny", "moe-tiny"


@dataclass(frozen=True)
class Case:
    """One run: ``name`` (the axes it exercises), ``grid`` (``--grid``, named sizes), extra
    ``tetrad train`` options ``args``, the model ``model``."""

    name: str
    grid: str
    args: tuple[str, ...] = ()
    model: str = DENSE

    @property
    def ranks(self) -> int:
        """Processes of the grid: the product of its sizes (``expert=`` adds no rank)."""
        sizes = dict(item.split("=") for item in self.grid.split(","))
        return math.prod(int(n) for axis, n in sizes.items() if axis != "expert")


ZERO, FINE = ("--shard-optimizer",), ("--overlap", ALL_OVERLAPS)

CASES: dict[int, list[Case]] = {
    2: [
        Case("data", "data=2"),
        Case("context", "context=2"),
        Case("z", "z=2"),
        Case("y", "y=2"),
        Case("x", "x=2"),
        Case("pipe", "pipe=2"),
        Case("zero", "data=2", ZERO),
        Case("fine", "y=2", FINE),
        Case("expert", "data=2,expert=2", model=MOE),
    ],
    4: [
        Case("data-z", "data=2,z=2"),
        Case("context-x", "context=2,x=2"),
        Case("y-x", "y=2,x=2"),
        Case("z4", "z=4"),
        Case("zero-data-context", "data=2,context=2", ZERO),
        Case("fine-data-y", "data=2,y=2", FINE),
        Case("pipe-data", "pipe=2,data=2"),
        Case("pipe-x", "pipe=2,x=2"),
        Case("expert4", "data=4,expert=4", model=MOE),
    ],
    8: [
        Case("z-y-x", "z=2,y=2,x=2"),
        Case("data-context-z", "data=2,context=2,z=2"),
        Case("data-y-x", "data=2,y=2,x=2"),
        Case("zero-data-z", "data=4,z=2", ZERO),
        Case("fine-data-z-x", "data=2,z=2,x=2", FINE),
        Case("pipe-data-y", "pipe=2,data=2,y=2"),
        Case("pipe-z-x", "pipe=2,z=2,x=2"),
        Case("expert8", "data=8,expert=4", model=MOE),
    ],
}
"""Per world size, the cases: every axis (data, context, Z, Y, X, pipe, expert), the sharded
optimizer and the ``fine`` rings over NCCL on 2 GPUs; combinations of them on 4 and 8."""


@dataclass(frozen=True)
class Sizes:
    """The run's sizes: ``steps`` optimizer steps of ``global_batch`` samples of ``seq_len``
    tokens, micro-batches of ``micro_batch`` samples."""

    steps: int
    global_batch: int = 8
    micro_batch: int = 1
    seq_len: int = 32


SIZES = {"cuda": Sizes(steps=4), "cpu": Sizes(steps=2, global_batch=4, seq_len=16)}
"""Per device: the CPU smoke mode is the smallest that splits on every case of 2 ranks."""


@dataclass
class Result:
    """One case's outcome (``verdict``: pass, fail or skipped; ``problems``: why not pass)."""

    name: str
    grid: str
    ranks: int
    options: str
    verdict: str = "skipped"
    seconds: float = 0.0
    loss_max_rel: float | None = None
    bytes_check: str = ""
    bytes: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def write_corpus(folder: Path, files: int = 4) -> Path:
    """A small Python-like corpus (``files`` files, about 1,500 BPE tokens each), the same on
    every call; the first files are the same whatever ``files`` is."""
    folder.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "None"]
    for i in range(files):
        lines = [f"def f{i}_{j}(x):\n    return x + {rnd.randint(0, 99)}\n" for j in range(60)]
        lines += [" ".join(rnd.choice(words) for _ in range(8)) + "\n" for _ in range(60)]
        (folder / f"m{i}.py").write_text("".join(lines))
    return folder


def train_command(
    case: Case, ranks: int, device: str, sizes: Sizes, corpus: Path, run_dir: Path
) -> list[str]:
    """``torchrun --standalone --nproc_per_node ranks -m tetrad.cli train`` of ``case``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "tetrad.cli",
        "train",
        f"--model={case.model}",
        f"--data={corpus}",
        "--vocab-size=300",
        f"--grid={case.grid}",
        f"--steps={sizes.steps}",
        f"--global-batch={sizes.global_batch}",
        f"--micro-batch={sizes.micro_batch}",
        f"--seq-len={sizes.seq_len}",
        "--seed=1234",
        f"--device={device}",
        "--log-every=1",
        "--val-every=1000",
        "--val-batches=1",
        "--checkpoint-every=0",
        f"--run-dir={run_dir}",
        *case.args,
    ]


def launch(cmd: list[str], log: Path, timeout_s: float) -> tuple[int, float]:
    """Run ``cmd`` with its output to ``log``: (exit status, seconds); 124 past ``timeout_s``."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
            code = rc.returncode
        except subprocess.TimeoutExpired:
            code = 124
    return code, time.perf_counter() - t0


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (none if it is missing)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def loss_check(rows: list[dict], reference: list[dict], tol: float) -> tuple[float, list[str]]:
    """Largest ``|loss - reference| / |reference|`` over the steps, and the problems: a step
    count that differs, a non-finite loss, a difference above ``tol``."""
    if len(rows) != len(reference) or not rows:
        return math.inf, [f"{len(rows)} steps recorded, the reference {len(reference)}"]
    worst, problems = 0.0, []
    for r, e in zip(rows, reference, strict=True):
        rel = abs(r["loss"] - e["loss"]) / abs(e["loss"])
        if not math.isfinite(rel):
            problems.append(f"step {r['step']}: loss {r['loss']} (reference {e['loss']})")
            rel = math.inf
        worst = max(worst, rel)
    if worst > tol:
        problems.append(f"losses differ from the reference by {worst:.2e} (tolerance {tol:.0e})")
    return worst, problems


def planned_bytes(config: dict) -> tuple[str, dict[str, float]]:
    """The planner's bytes per axis of one step on rank 0 of the run ``config`` (its
    ``config.json``): ``("all axes", {axis: bytes})`` for a dense grid without a pipeline,
    ``("pipe", {"pipe": bytes})`` for a pipeline, ``("none", {})`` for an MoE model."""
    from tetrad.plan.comm.listing import axis_totals
    from tetrad.plan.machine.description import get_machine
    from tetrad.plan.pipe.schedule import p2p_bytes
    from tetrad.plan.step_time import collectives
    from tetrad.spec.grid import role_sizes
    from tetrad.spec.model import ModelSpec
    from tetrad.spec.overlap import FINE_CHUNKS, parse_overlaps
    from tetrad.spec.precision import DTYPE_BYTES
    from tetrad.spec.units import MiB

    mc = ModelSpec(**config["model_config"])
    par, t = config["parallelism"], config["training"]
    # the roles: under orientation yx the --grid's Y splits the residual stream's hidden size
    data, context, z, _, x = role_sizes(tuple(par["grid"]), par["orientation"])
    params = config["precision"]["params"]  # bf16 weights compute in bf16 on the CPU too
    c = DTYPE_BYTES["bf16" if t["device"] == "cuda" or params == "bf16" else "fp32"]
    if mc.n_experts:
        return "none", {}
    if par["pipe"] > 1:  # rank 0 holds stages 0, p, 2p...: each sends forward, all but 0 back
        p, v = par["pipe"], par["virtual_stages"]
        m = t["global_batch"] // (data * z) // t["micro_batch"]
        per = p2p_bytes(t["micro_batch"], t["seq_len"], mc.dim, context, x, c)
        sends = 2 * v - 1
        return "pipe", {"pipe": per * m * sends + 2 * (p - 1) / p * 4}
    overlaps = parse_overlaps(par["overlap"])
    named_fine = "fine" in overlaps and par["overlap"] not in ("all", "none")
    cols = collectives(
        mc,
        get_machine("dgx-h100"),  # the bytes do not depend on the machine
        tuple(par["grid"]),
        t["micro_batch"],
        t["seq_len"],
        t["global_batch"],
        activation_checkpointing=par["activation_checkpointing"],
        overlaps=overlaps if named_fine else overlaps - {"fine"},  # as without --machine
        compute_bytes=c,
        bucket_bytes=int(par["dp_bucket_mb"] * MiB),
        domino_min_rows=par["domino_min_rows"],
        fine_chunks=par["fine_chunks"] or FINE_CHUNKS,
        orientation=par["orientation"],
        context_pieces=par["context_pieces"] or 1,
        shard_optimizer=par["shard_optimizer"],
        sequence_parallel=par["sequence_parallel"],
        param_bytes=DTYPE_BYTES[params],
    )
    return "all axes", {a: tot["bytes"] for a, tot in axis_totals(cols).items()}


def bytes_check(rows: list[dict], config: dict) -> tuple[str, dict, list[str]]:
    """Rank 0's recorded bytes per axis from step 2 on against :func:`planned_bytes`: the
    check's name (``equal``, ``pipe equal``, ``recorded``, or ``differs``), per axis
    ``[recorded, planned]`` (planned None where not modelled), and the problems."""
    scope, planned = planned_bytes(config)
    later = rows[1:]
    if not later:
        return "differs", {}, ["fewer than 2 steps: no step to compare bytes"]
    axes = sorted({a for r in later for a in r["comm_bytes"]} | set(planned))
    table = {a: [later[-1]["comm_bytes"].get(a, 0), planned.get(a)] for a in axes}
    problems = []
    for r in later:
        for a in {"all axes": axes, "pipe": list(planned), "none": []}[scope]:
            got, want = r["comm_bytes"].get(a, 0), planned.get(a, 0)
            if got != want:
                problems.append(f"step {r['step']} axis {a}: {got:.0f} bytes, planner {want:.0f}")
    if problems:
        return "differs", table, problems
    return {"all axes": "equal", "pipe": "pipe equal", "none": "recorded"}[scope], table, []


def ran_check(case: Case, rows: list[dict]) -> list[str]:
    """What the case must have run: the fused rings of ``fine``, an MoE model's routing."""
    problems = []
    if "fine" in case.args and not all(r["overlaps_ran"].get("fine_fused", 0) for r in rows):
        problems.append("the fine overlap's fused rings did not run on every step")
    if case.model == MOE and not all("moe_max_load" in r for r in rows):
        problems.append("no routing figures (moe_max_load) recorded")
    return problems


def judge(case: Case, run_dir: Path, reference: list[dict], tol: float, result: Result) -> None:
    """Fill ``result``'s checks from ``run_dir`` against ``reference``'s rows."""
    rows = read_metrics(run_dir)
    result.loss_max_rel, problems = loss_check(rows, reference, tol)
    config_path = run_dir / "config.json"
    if rows and config_path.exists():
        config = json.loads(config_path.read_text())
        result.bytes_check, result.bytes, more = bytes_check(rows, config)
        problems += more + ran_check(case, rows)
    result.problems += problems
    result.verdict = "fail" if result.problems else "pass"


def report(results: list[Result], header: str) -> str:
    """The Markdown table of ``results``, one row per case, then each problem."""
    lines = [
        header,
        "",
        "| case | grid | ranks | options | losses max rel diff | bytes | verdict | s |",
        "|---|---|---:|---|---:|---|---|---:|",
    ]
    for r in results:
        rel = "" if r.loss_max_rel is None else f"{r.loss_max_rel:.1e}"
        lines.append(
            f"| {r.name} | {r.grid} | {r.ranks} | {r.options} | {rel} | {r.bytes_check} | "
            f"{r.verdict} | {r.seconds:.0f} |"
        )
    lines.append("")
    for r in results:
        lines += [f"- {r.name}: {p}" for p in r.problems]
        if r.bytes:
            per = ", ".join(
                f"{a} {got:.0f}" + ("" if want is None else f" (planner {want:.0f})")
                for a, (got, want) in r.bytes.items()
            )
            lines.append(f"- {r.name} bytes per step on rank 0: {per}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the cases and write the report; 0 when every case passes."""
    from benchmarks.gpu.equivalence import TOLERANCES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/multi_gpu_check"))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--nproc", type=int, choices=sorted(CASES), default=2)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="no case starts after this")
    args = ap.parse_args(argv)
    cases = CASES[args.nproc]
    if args.only:
        names = args.only.split(",")
        unknown = sorted(set(names) - {c.name for c in cases})
        if unknown:
            print(
                f"multi_gpu_check: no case {', '.join(unknown)} on {args.nproc} ranks; "
                f"choose from {', '.join(c.name for c in cases)}"
            )
            return 2
        cases = [c for c in cases if c.name in names]
    sizes, tol = SIZES[args.device], TOLERANCES["bf16" if args.device == "cuda" else "fp32"]
    out, start = args.out, time.perf_counter()
    work = out / "runs"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TETRAD_CACHE", str(out / "cache"))
    corpus = write_corpus(out / "corpus")
    references: dict[str, list[dict]] = {}
    results: list[Result] = []
    for case in cases:
        options = " ".join(case.args).replace(ALL_OVERLAPS, "(every name: fine on)")
        res = Result(case.name, case.grid, case.ranks, options or "-")
        results.append(res)
        left = args.budget_s - (time.perf_counter() - start)
        if left < 20:
            res.problems.append(f"skipped: {left:.0f} s of the budget left")
            continue
        if case.model not in references:  # the one-process run on the grid 1,1,1,1
            ref = Case(f"reference-{case.model}", "1,1,1,1", model=case.model)
            run_dir = work / ref.name
            cmd = train_command(ref, 1, args.device, sizes, corpus, run_dir)
            code, _ = launch(cmd, out / "logs" / f"{ref.name}.log", left)
            references[case.model] = read_metrics(run_dir) if code == 0 else []
            left = args.budget_s - (time.perf_counter() - start)
        reference = references[case.model]
        if not reference:
            res.problems.append(f"the reference run failed (logs/reference-{case.model}.log)")
            res.verdict = "fail"
            continue
        run_dir = work / case.name
        cmd = train_command(case, case.ranks, args.device, sizes, corpus, run_dir)
        code, res.seconds = launch(cmd, out / "logs" / f"{case.name}.log", max(left, 20))
        print(
            f"multi_gpu_check: {case.name} ({case.grid}) exit status {code}, {res.seconds:.0f} s",
            flush=True,
        )
        if code != 0:
            res.problems.append(f"tetrad train exit status {code} (logs/{case.name}.log)")
        judge(case, run_dir, reference, tol.loss_rel, res)
    header = (
        f"# multi_gpu_check: {args.device}, {args.nproc} ranks, {sizes.steps} steps of "
        f"{sizes.global_batch} x {sizes.seq_len} tokens, loss tolerance {tol.loss_rel:.0e} "
        f"relative, {time.perf_counter() - start:.0f} s"
    )
    text = report(results, header)
    (out / "multi_gpu_check.md").write_text(text)
    (out / "multi_gpu_check.json").write_text(
        json.dumps({"header": header, "cases": [asdict(r) for r in results]}, indent=1) + "\n"
    )
    print(text, end="")
    return 0 if all(r.verdict == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
