"""The tables of ``benchmarks/vs_pytorch.py``: per job the pooled medians, bytes and losses,
one row per (tetrad grid, stock mode) and the best of each side."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stock_parallel import Stock
    from vs_jobs import Job

LOSS_TOLERANCE = 1e-4
MB = 1e6


def summarise(runs: list[dict], warmup: int) -> dict:
    """Pool the runs of one job: the median step time over the steps after ``warmup``, the
    first and last losses, and the bytes and calls per step (of the last run)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"]}
    times = [t for r in ok for t in r["times"][warmup:]]
    return {
        "median_s": statistics.median(times),
        "repeat_medians_s": [statistics.median(r["times"][warmup:]) for r in ok],
        "loss_first": ok[0]["losses"][0],
        "loss_last": ok[0]["losses"][-1],
        "bytes": ok[-1]["bytes"],
        "calls": ok[-1]["calls"],
        "total_mb": sum(ok[-1]["bytes"].values()) / MB,
    }


def loss_ok(a: dict, b: dict) -> bool:
    if "error" in a or "error" in b:
        return False
    return abs(a["loss_first"] - b["loss_first"]) <= LOSS_TOLERANCE * abs(b["loss_first"])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


def table_row(job: Job, stock: Stock, t: dict, p: dict, ref: dict) -> list[str]:
    """One printed row: tetrad grid vs stock mode (``ref``: the loss everything must match)."""
    name = job.name()
    if "error" in t or "error" in p:
        err = t.get("error") or p.get("error")
        return [name, "-", str(stock), "-", "-", "-", "-", "-", "-", "-", f"FAIL {err}"]
    ok = loss_ok(t, ref) and loss_ok(p, ref)
    return [
        name,
        f"{t['median_s']:.3f}",
        str(stock),
        f"{p['median_s']:.3f}",
        _ratio(t["median_s"], p["median_s"]),
        f"{t['total_mb']:.1f}",
        f"{p['total_mb']:.1f}",
        _ratio(t["total_mb"], p["total_mb"]),
        f"{t['loss_first']:.6f}",
        f"{p['loss_first']:.6f}",
        "ok" if ok else "MISMATCH",
    ]


HEADER = [
    "tetrad grid",
    "tetrad s/step",
    "stock mode",
    "stock s/step",
    "time ratio",
    "tetrad MB/step",
    "stock MB/step",
    "bytes ratio",
    "loss1 tetrad",
    "loss1 stock",
    "losses",
]


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [HEADER, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


ORDER = [
    "pipe",
    "data",
    "z",
    "y",
    "x",
    "world",
    "send",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
]
"""The order of the per-axis (tetrad) and per-kind (stock) byte counts in the report."""


def detail_lines(results: dict[Job, dict], world: int) -> list[str]:
    """Per job: the median s/step of each repeat, then the bytes per step by axis (tetrad) or
    collective kind (stock), with call counts."""
    lines = []
    for job, r in results.items():
        if job.world != world or "error" in r:
            continue
        keys = sorted(r["bytes"], key=lambda k: (ORDER.index(k) if k in ORDER else len(ORDER), k))
        parts = [f"{k} {r['bytes'][k] / MB:.2f} MB/{r['calls'][k]} calls" for k in keys]
        times = "/".join(f"{t:.3f}" for t in r["repeat_medians_s"])
        lines.append(f"  {job.label():<20} {times} s; {'; '.join(parts) or 'no collectives'}")
    return lines


def best_line(results: dict[Job, dict], world: int) -> str:
    """tetrad's fastest grid against the fastest stock mode at ``world``."""
    done = {j: r for j, r in results.items() if j.world == world and "error" not in r}
    tetrad = [j for j in done if j.grid]
    stock = [j for j in done if j.stock]
    if not tetrad or not stock:
        return f"world {world}: best vs best: not available"
    bt = min(tetrad, key=lambda j: done[j]["median_s"])
    bs = min(stock, key=lambda j: done[j]["median_s"])
    t, p = done[bt]["median_s"], done[bs]["median_s"]
    return (
        f"world {world}: best tetrad {bt.name()} {t:.3f} s/step vs "
        f"best stock "
        f"{bs.stock} {p:.3f} s/step: time ratio {t / p:.2f}"
    )
