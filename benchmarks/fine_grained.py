"""Fused GEMM -> reduce-scatter against GEMM then reduce-scatter, per sublayer, in the style of
T3's evaluation (Pati et al., arXiv 2401.16677), with the planner's prediction next to each row.

Sublayers (T3's: a GEMM whose output is reduced over the tensor-parallel group): forward
attention output projection (OP, ``k = h``) and MLP down projection (FC-2, ``k = 4h``); backward
input gradient of the QKV projection (IP, ``k = 3h``) and of the MLP up projection (FC-1,
``k = 4h``). Each is ``[m, k/G] @ [k/G, h] -> [m, h]`` partial sums, reduce-scattered over ``G``
ranks to ``[m/G, h]``. Shapes are T3's models scaled down for a CPU: hidden ``h`` divided by 8
(Mega-GPT-2 3072 -> 384; T-NLG 4256 -> 528, rounded to a multiple of 16), ``m = 1024`` tokens
(``--tokens``), fp32.

Per row, medians over ``--repeats`` interleaved repetitions of the slowest rank's time:
GEMM alone, the collective alone (``tetrad.comm.reduce_scatter``, what the runtime issues
without ``fine``; gloo has no reduce-scatter, so it is an all-reduce keeping one chunk),
sequential (GEMM then collective), fused (``tetrad.comm.fused.ring_matmul_reduce_scatter`` at
the chunk count the model picks), ideal ``max(GEMM, collective)``, speed-up over sequential and
the fraction of the ideal gain reached ``(seq - fused) / (seq - ideal)``.

Predicted: :func:`tetrad.plan.comm.fine.ring_reduce_scatter_seconds` (the planner's replay of the
fused ring) fed with this run's own measurements of its parts: each piece's GEMM alone (the
chunking overhead table), one ring exchange of a piece (latency and bandwidth fitted over the
piece sizes) and the contention factor of :func:`tetrad.calibrate.measure.
measure_overlap_slowdown` (a GEMM beside an all-reduce). ``q*``: the chunk count the model picks
from (1, 2, 4, 8); ``best q``: the measured fastest.

    python benchmarks/fine_grained.py [--groups 2 4 8] [--repeats 15] [--tokens 1024] [--json F]

With CUDA visible it also prints the single-GPU part: a bf16 GEMM of each unscaled sublayer
(TP 8) split into k row pieces against the whole GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed import run_distributed  # noqa: E402
from tetrad.calibrate.measure import measure_overlap_slowdown  # noqa: E402
from tetrad.calibrate.settings import settings  # noqa: E402
from tetrad.comm import reduce_scatter  # noqa: E402
from tetrad.comm.fused import ring_matmul_reduce_scatter  # noqa: E402
from tetrad.grid import Grid  # noqa: E402
from tetrad.plan.comm.fine import CHUNK_CANDIDATES, ring_reduce_scatter_seconds
from tetrad.plan.machine.network import Link
from tetrad.spec.grid import Axis

MODELS = {"Mega-GPT-2": 3072, "T-NLG": 4256}
SCALED = {"Mega-GPT-2": 384, "T-NLG": 528}
SUBLAYERS = (("OP fwd", 1), ("FC-2 fwd", 4), ("IP bwd", 3), ("FC-1 bwd", 4))


def _slowest(t: float) -> float:
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x.item())


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t0)


def _ring_exchange(grid: Grid, rows: int, h: int):
    """One ring step of a piece ``[rows, h]``: send to the next rank, receive from the previous."""
    g, r = grid.x, dist.get_rank()
    out, inp = torch.randn(rows, h), torch.empty(rows, h)

    def fn() -> None:
        works = [dist.isend(out, (r + 1) % g), dist.irecv(inp, (r - 1) % g)]
        for w in works:
            w.wait()

    return fn


def _fit_link(g: int, points: list[tuple[float, float]]) -> Link:
    """``seconds = alpha + bytes / bandwidth`` by least squares over ``(bytes, seconds)``."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)
    alpha = max(my - slope * mx, 0.0)
    return Link(g, 1, g, 1, 1.0 / slope, 0.0, alpha)


def worker(g: int, tokens: int, repeats: int, out: str) -> None:
    grid = Grid.build((1, 1, 1, g))
    rows = []
    s = settings("cpu", quick=True)
    for model, h in SCALED.items():
        for name, mult in SUBLAYERS:
            k = mult * h // g
            torch.manual_seed(dist.get_rank())
            y, w = torch.randn(tokens, k), torch.randn(h, k)
            flops, payload = 2.0 * tokens * k * h, tokens * h * 4.0

            def gemm(y=y, w=w):
                return y @ w.t()

            partial = gemm()

            def coll(p=partial):
                reduce_scatter(p, grid, Axis.X)

            def seq(y=y, w=w):
                reduce_scatter(y @ w.t(), grid, Axis.X)

            variants = {"gemm": gemm, "collective": coll, "sequential": seq}
            pieces, exchange = {}, {}
            for q in CHUNK_CANDIDATES:
                variants[f"fused{q}"] = lambda y=y, w=w, q=q: ring_matmul_reduce_scatter(
                    y, w, grid, Axis.X, q
                )
                r = tokens // (g * q)
                variants[f"piece{q}"] = lambda y=y[:r], w=w: y @ w.t()
                variants[f"ring{q}"] = _ring_exchange(grid, r, h)
                pieces[q], exchange[q] = r, r * h * 4.0
            times: dict[str, list[float]] = {v: [] for v in variants}
            for fn in variants.values():  # warm-up: connect the pairs, fault in the buffers
                fn()
            for _ in range(repeats):
                for v, fn in variants.items():
                    times[v].append(_timed(fn))
            med = {v: statistics.median(t) for v, t in times.items()}
            slow = measure_overlap_slowdown(
                torch.device("cpu"), torch.float32, s, (tokens // g, h, k)
            )["slowdown"]
            link = _fit_link(g, [(exchange[q], med[f"ring{q}"]) for q in CHUNK_CANDIDATES])
            piece_s = {flops / (g * q): med[f"piece{q}"] for q in CHUNK_CANDIDATES}
            piece_s[flops] = med["gemm"]

            def gemm_s(f, table=piece_s):
                return table[min(table, key=lambda x: abs(x - f))]

            pred = {
                q: ring_reduce_scatter_seconds(gemm_s, flops, payload, link, q, slow)
                for q in CHUNK_CANDIDATES
            }
            q_pred = min(pred, key=pred.get)
            q_best = min(CHUNK_CANDIDATES, key=lambda q: med[f"fused{q}"])
            rows.append(
                {
                    "model": model,
                    "sublayer": name,
                    "G": g,
                    "m": tokens,
                    "k": k,
                    "h": h,
                    **{v: med[v] for v in ("gemm", "collective", "sequential")},
                    "fused": med[f"fused{q_pred}"],
                    "fused_best": med[f"fused{q_best}"],
                    "predicted_fused": pred[q_pred],
                    "q_pred": q_pred,
                    "q_best": q_best,
                    "slowdown": slow,
                    "chunking": {
                        q: g * q * med[f"piece{q}"] / med["gemm"] for q in CHUNK_CANDIDATES
                    },
                }
            )
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def gpu_chunking() -> None:
    """Single GPU: bf16 GEMM of each unscaled sublayer at TP 8 split into k row pieces vs whole."""
    dev = torch.device("cuda")
    print("\nGEMM chunking overhead on one GPU (bf16, unscaled T3 shapes at TP 8, m = 4096):")
    print(
        f"{'model':<11} {'sublayer':<9} {'whole ms':>9}"
        + "".join(f" {k:>6}" for k in (2, 4, 8, 16))
    )
    for model, h in MODELS.items():
        for name, mult in SUBLAYERS:
            k = mult * h // 8
            y = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(h, k, device=dev, dtype=torch.bfloat16)
            out = torch.empty(4096, h, device=dev, dtype=torch.bfloat16)

            def run(pieces: int, y=y, w=w, out=out) -> float:
                step = 4096 // pieces
                for _ in range(3):
                    for i in range(pieces):
                        torch.matmul(
                            y[i * step : (i + 1) * step], w.t(), out=out[i * step : (i + 1) * step]
                        )
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(20):
                    for i in range(pieces):
                        torch.matmul(
                            y[i * step : (i + 1) * step], w.t(), out=out[i * step : (i + 1) * step]
                        )
                e1.record()
                e1.synchronize()
                return e0.elapsed_time(e1) / 20

            whole = run(1)
            ratios = "".join(f" {run(p) / whole:>6.2f}" for p in (2, 4, 8, 16))
            print(f"{model:<11} {name:<9} {whole:>9.3f}{ratios}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for g in args.groups:
            out = str(Path(tmp) / f"g{g}.json")
            run_distributed(worker, g, g, args.tokens, args.repeats, out)
            rows += json.loads(Path(out).read_text())
    print(
        f"Fused GEMM -> reduce-scatter vs sequential, CPU gloo, {torch.get_num_threads()} "
        f"threads here, 1 per rank; m = {args.tokens} tokens, fp32; medians of "
        f"{args.repeats} interleaved repetitions, slowest rank; ms"
    )
    head = (
        f"{'model':<11} {'sublayer':<9} {'G':>2} {'GEMM':>7} {'coll':>7} {'seq':>7} "
        f"{'fused':>7} {'ideal':>7} {'speedup':>7} {'of ideal':>8} | {'pred':>7} "
        f"{'pred sp':>7} {'q*':>3} {'best q':>6} {'slow':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ideal = max(r["gemm"], r["collective"])
        gain = r["sequential"] - ideal
        frac = (r["sequential"] - r["fused"]) / gain if gain > 0 else float("nan")
        ms = {k: r[k] * 1e3 for k in ("gemm", "collective", "sequential", "fused")}
        print(
            f"{r['model']:<11} {r['sublayer']:<9} {r['G']:>2} {ms['gemm']:>7.2f} "
            f"{ms['collective']:>7.2f} {ms['sequential']:>7.2f} {ms['fused']:>7.2f} "
            f"{ideal * 1e3:>7.2f} {r['sequential'] / r['fused']:>7.2f} {frac:>8.0%} | "
            f"{r['predicted_fused'] * 1e3:>7.2f} {r['sequential'] / r['predicted_fused']:>7.2f} "
            f"{r['q_pred']:>3} {r['q_best']:>6} {r['slowdown']:>5.2f}"
        )
    wins = [r["sequential"] > r["fused"] for r in rows]
    pred_wins = [r["sequential"] > r["predicted_fused"] for r in rows]
    errors = sorted(abs(r["predicted_fused"] / r["fused"] - 1) for r in rows)
    print(
        f"fused faster than sequential in {sum(wins)} of {len(rows)} rows (predicted: "
        f"{sum(pred_wins)}); sign of the gain predicted right in "
        f"{sum(a == b for a, b in zip(wins, pred_wins, strict=True))} of {len(rows)}; "
        f"fused time predicted within {100 * errors[len(errors) // 2]:.0f}% (median), "
        f"{100 * errors[-1]:.0f}% (worst)"
    )
    for g in sorted({r["G"] for r in rows}):
        sub = [r for r in rows if r["G"] == g]
        sp = statistics.geometric_mean(r["sequential"] / r["fused"] for r in sub)
        psp = statistics.geometric_mean(r["sequential"] / r["predicted_fused"] for r in sub)
        print(f"  G={g}: speed-up geomean measured {sp:.2f}x, predicted {psp:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\nGEMM chunking overhead (CPU, per rank, all ranks at once): G q pieces / whole GEMM")
    print(
        f"{'model':<11} {'sublayer':<9} {'G':>2}"
        + "".join(f" {'q=' + str(q):>6}" for q in CHUNK_CANDIDATES)
    )
    for r in rows:
        cells = "".join(f" {r['chunking'][str(q)]:>6.2f}" for q in CHUNK_CANDIDATES)
        print(f"{r['model']:<11} {r['sublayer']:<9} {r['G']:>2}{cells}")
    if torch.cuda.is_available():
        gpu_chunking()


if __name__ == "__main__":
    main()
