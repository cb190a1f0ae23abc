"""``tetrad report RUN_DIR``: where a run's step time went, and how an MoE model routed, from its
``metrics.jsonl``.

Every axis the rows record is shown (the grid's, the pipeline's point-to-point and the experts'
all-to-alls alike), and a run resumed on another grid is reported one segment per grid (rows
record their grid; rows written before they did form one segment). Within a segment the
exposed total is the mean over its steps of the sum of the rows' ``comm_exposed_s``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from tetrad.spec.grid import Axis
from tetrad.train.config import ConfigError
from tetrad.train.metrics import read_rows

REPORT_AXES = (
    Axis.X,
    Axis.Y,
    Axis.Z,
    Axis.CONTEXT,
    Axis.DATA,
    Axis.EXPERT,
    Axis.EXPERT_DATA,
    Axis.PIPE,
    Axis.WORLD,
)
"""The order of the axes in a report, inner to outer; an axis a row records that is not here
comes after them, by name."""


def load_metrics(run_dir: str | Path) -> tuple[list[dict], int]:
    """The rows of ``RUN_DIR/metrics.jsonl`` and the number of lines skipped (a last line a
    crash cut short: :func:`tetrad.train.metrics.read_rows`).

    Raises:
        ConfigError: no such file, or no rows with communication records in it.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: pass the --run-dir of a tetrad train run")
    rows, skipped = read_rows(path)
    rows = [r for r in rows if "comm_exposed_s" in r]
    if not rows:
        raise ConfigError(f"{path} has no steps with communication records")
    return rows, skipped


def row_axes(rows: list[dict]) -> list[str]:
    """Every axis any of ``rows`` records bytes, time or exposed time for, in
    :data:`REPORT_AXES` order (others after, by name)."""
    keys = ("comm_bytes", "comm_time_s", "comm_exposed_s")
    seen = {a for r in rows for k in keys for a in r.get(k, {})}
    known = [str(a) for a in REPORT_AXES if a in seen]
    return known + sorted(seen - set(known))


def segments(rows: list[dict]) -> list[list[dict]]:
    """``rows`` split where the grid changes (a run resumed on another grid), in order."""
    return [list(g) for _, g in itertools.groupby(rows, key=lambda r: r.get("grid"))]


def summarize(rows: list[dict], skip: int = 1) -> dict:
    """Mean per step over ``rows`` (one grid's) after the first ``skip`` (the first step records
    the prefetch order and warms up): step time, exposed and total communication time per axis
    (seconds), ring bytes per axis, and compute = step time - all exposed communication; its
    ``grid`` is the rows' (None for rows that do not record it)."""
    use = rows[skip:] or rows
    n = len(use)

    def mean(key: str, axis: str | None = None) -> float:
        if axis is None:
            return sum(r[key] for r in use) / n
        return sum(r[key].get(axis, 0.0) for r in use) / n

    axes = row_axes(use)
    out = {
        "grid": use[0].get("grid"),
        "steps": n,
        "first_step": use[0]["step"],
        "last_step": use[-1]["step"],
        "step_time_s": mean("step_time_s"),
        "tokens_per_s": mean("tokens_per_s"),
        "mfu": mean("mfu"),
        "axes": {
            a: {
                "bytes": mean("comm_bytes", a),
                "time_s": mean("comm_time_s", a),
                "exposed_s": mean("comm_exposed_s", a),
            }
            for a in axes
        },
    }
    exposed = sum(v["exposed_s"] for v in out["axes"].values())
    out["exposed_s"] = exposed
    out["compute_s"] = out["step_time_s"] - exposed
    return out


def format_report(s: dict) -> str:
    """A plain-text table of :func:`summarize`'s result."""
    grid = f"grid {s['grid']}, " if s.get("grid") else ""
    lines = [
        f"{grid}steps {s['first_step']}-{s['last_step']} (mean of {s['steps']}): "
        f"step {s['step_time_s'] * 1e3:.1f} ms, {s['tokens_per_s']:,.0f} tokens/s, "
        f"MFU {100 * s['mfu']:.1f}%",
        f"  compute (step - exposed comm) {s['compute_s'] * 1e3:9.1f} ms",
        f"  exposed communication         {s['exposed_s'] * 1e3:9.1f} ms "
        f"({100 * s['exposed_s'] / s['step_time_s']:.0f}% of the step)",
        "",
        "  (comm ms: summed issue-to-completion time of the axis's collectives; concurrent ones\n"
        "   add up, so it can exceed the step. exposed ms: time the step actually waited.)",
        f"  {'axis':<12}{'MB sent/rank':>14}{'comm ms':>10}{'exposed ms':>12}{'hidden':>8}",
    ]
    for axis, v in s["axes"].items():
        hidden = 1 - v["exposed_s"] / v["time_s"] if v["time_s"] else 0.0
        lines.append(
            f"  {axis:<12}{v['bytes'] / 1e6:>14.2f}{v['time_s'] * 1e3:>10.1f}"
            f"{v['exposed_s'] * 1e3:>12.1f}{100 * hidden:>7.0f}%"
        )
    return "\n".join(lines)


def plot_report(summaries: list[dict], path: str | Path) -> None:
    """Bar charts, one row per grid segment: the step split into compute and exposed
    communication per axis, and per axis the communication time next to its exposed part.
    Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summaries)
    fig, grid = plt.subplots(n, 2, figsize=(10, 4 * n), squeeze=False)
    for s, (left, right) in zip(summaries, grid, strict=True):
        _plot_segment(s, left, right)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_segment(s: dict, left, right) -> None:
    where = f" (grid {s['grid']})" if s.get("grid") else ""
    bottom = s["compute_s"] * 1e3
    left.bar(["step"], [bottom], label="compute")
    for axis, v in s["axes"].items():
        left.bar(["step"], [v["exposed_s"] * 1e3], bottom=[bottom], label=f"exposed {axis}")
        bottom += v["exposed_s"] * 1e3
    left.set_ylabel("ms per step")
    left.set_title(f"step time, steps {s['first_step']}-{s['last_step']}{where}", fontsize=9)
    left.legend(fontsize=8)
    axes = list(s["axes"])
    idx = range(len(axes))
    right.bar(
        [i - 0.2 for i in idx],
        [s["axes"][a]["time_s"] * 1e3 for a in axes],
        0.4,
        label="issue to completion",
    )
    right.bar(
        [i + 0.2 for i in idx],
        [s["axes"][a]["exposed_s"] * 1e3 for a in axes],
        0.4,
        label="exposed (waited)",
    )
    right.set_xticks(list(idx), axes)
    right.set_ylabel("ms per step")
    right.set_title("communication per mesh axis", fontsize=9)
    right.legend(fontsize=8)


def format_routing(rows: list[dict]) -> str:
    """An MoE run's routing per block over ``rows`` (:mod:`tetrad.train.routing`): the max/mean
    expert load (first, mean, worst and last step) and the normalised balance term (mean and
    last); empty for rows without routing records (a dense model)."""
    rows = [r for r in rows if "moe_max_load" in r]
    if not rows:
        return ""
    balance = "moe_balance" in rows[-1]
    lines = [
        f"MoE routing, steps {rows[0]['step']}-{rows[-1]['step']} (max/mean expert load: 1 "
        "balanced; balance term / coefficient: 1 balanced)",
        f"  {'block':<6}{'load first':>11}{'mean':>8}{'worst':>8}{'last':>8}"
        + (f"{'balance mean':>14}{'last':>8}" if balance else ""),
    ]
    for block in rows[-1]["moe_max_load"]:
        loads = [r["moe_max_load"][block] for r in rows if block in r.get("moe_max_load", {})]
        line = (
            f"  {block:<6}{loads[0]:>11.3f}{sum(loads) / len(loads):>8.3f}{max(loads):>8.3f}"
            f"{loads[-1]:>8.3f}"
        )
        if balance:
            b = [r["moe_balance"][block] for r in rows if block in r.get("moe_balance", {})]
            line += f"{sum(b) / len(b):>14.3f}{b[-1]:>8.3f}"
        lines.append(line)
    return "\n".join(lines)


def plot_routing(rows: list[dict], path: str | Path) -> None:
    """Charts of an MoE run: per block, the max/mean expert load and the normalised balance
    term over the steps; below, where the rows list them (``moe_expert_load``), each block's
    load per expert over the steps (over the mean: 1 balanced). Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "moe_max_load" in r]
    blocks = list(rows[-1]["moe_max_load"])
    experts = [r for r in rows if "moe_expert_load" in r]
    cols = 4  # heat maps per row, below the two line charts
    rows_of_maps = -(-len(blocks) // cols) if experts else 0
    fig = plt.figure(figsize=(16, 4 + 3.5 * rows_of_maps))
    grid = fig.add_gridspec(1 + rows_of_maps, cols)
    for i, (key, title) in enumerate(
        (("moe_max_load", "max/mean expert load"), ("moe_balance", "balance term / coefficient"))
    ):
        ax = fig.add_subplot(grid[0, 2 * i : 2 * i + 2])
        for block in rows[-1].get(key, {}):
            got = [(r["step"], r[key][block]) for r in rows if block in r.get(key, {})]
            ax.plot([s for s, _ in got], [v for _, v in got], label=f"block {block}")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel("step")
        ax.set_title(title)
        if rows[-1].get(key):
            ax.legend(fontsize=7)
    steps = [r["step"] for r in experts]
    for j, block in enumerate(blocks if experts else []):
        ax = fig.add_subplot(grid[1 + j // cols, j % cols])
        loads = [r["moe_expert_load"][block] for r in experts]
        image = ax.imshow(
            list(zip(*loads, strict=True)),
            aspect="auto",
            origin="lower",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, len(loads[0]) - 0.5),
        )
        ax.set_title(f"block {block}: load per expert / mean", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
        fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(run_dir: str | Path, plot: bool = True) -> str:
    """Summarize a run; with ``plot`` also write ``RUN_DIR/report.png`` (and for an MoE model
    ``RUN_DIR/routing.png``: :func:`plot_routing`). Returns the text."""
    rows, skipped = load_metrics(run_dir)
    parts = [summarize(seg) for seg in segments(rows)]
    text = "\n\n".join(format_report(s) for s in parts)
    if len(parts) > 1:
        text = (
            f"the run changed grid {len(parts) - 1} time(s) (resumed on another): one summary "
            "per grid\n\n" + text
        )
    routing = format_routing(rows)
    if routing:
        text += "\n\n" + routing
    if skipped:
        text += (
            f"\n\n(skipped {skipped} line(s) of metrics.jsonl that are not complete rows: a "
            "crash cuts the last one short)"
        )
    if plot:
        out = Path(run_dir) / "report.png"
        plot_report(parts, out)
        text += f"\n\nchart: {out}"
        if routing:
            plot_routing(rows, Path(run_dir) / "routing.png")
            text += f", routing: {Path(run_dir) / 'routing.png'}"
    return text
