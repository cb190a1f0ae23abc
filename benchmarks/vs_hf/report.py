"""The report of ``benchmarks/vs_transformers.py``: the Markdown table (one row per shape,
variant and side, the time ratio tetrad/HF on tetrad's row), a round's progress line and the
list of problems (what failed, was skipped or does not match)."""

from __future__ import annotations

from tetrad.spec.units import GiB

from .rounds import SIDES, Shape


def _gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GiB:.2f} GiB"


def markdown(result: dict) -> str:
    """The Markdown report: a header, then one row per (shape, variant, side) with the time
    ratio tetrad/HF on tetrad's row."""
    env, m = result["environment"], result["models"]
    head = (
        f"# tetrad vs transformers: {env['device_name']} ({env['device']})\n\n"
        f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, "
        f"{env['started']}, {result.get('wall_s', 0):.0f} s. Model {result['settings']['model']}: "
        f"{m['tetrad_params']:,} parameters in tetrad, {m['hf_params']:,} in HF"
        f"{'' if m['tetrad_params'] == m['hf_params'] else ' (NOT EQUAL)'}; HF SDPA call: "
        f"{m.get('hf_sdpa')}. {result['settings']['rounds']} rounds x "
        f"{result['settings']['steps']} timed steps after {result['settings']['warmup']} "
        "warm-up, medians.\n\n"
    )
    rows = [
        "| shape (seq x micro-batch) | variant | side | s/step | per-round medians | tokens/s "
        "| MFU | peak memory | time ratio tetrad/HF |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        for side in SIDES:
            s = r[side]
            if "error" in s:
                cells = [s["error"].replace("|", "/"), "", "", "", "", ""]
            else:
                mfu = "n/a" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
                ratio = r.get("time_ratio")
                cells = [
                    f"{s['median_step_s']:.3f}",
                    " / ".join(f"{t:.3f}" for t in s["round_medians_s"]),
                    f"{s['tokens_per_s']:,.0f}",
                    mfu,
                    _gib(s["peak_memory_bytes"]),
                    f"{ratio:.3f}" if side == "tetrad" and ratio is not None else "",
                ]
            rows.append("| " + " | ".join([r["shape"], r["variant"], side, *cells]) + " |")
    notes = "".join(f"\n- {p}" for p in result["problems"])
    return head + "\n".join(rows) + ("\n\nProblems:" + notes if notes else "") + "\n"


def round_line(rd: dict, shape: Shape) -> str:
    """One progress line of a round (with the bytes still allocated before its build when
    they exceed 256 MiB: something of the previous round survived and counts in this peak)."""
    if "error" in rd:
        return rd["error"]
    med = rd["median_step_s"]
    line = (
        f"build {rd['build_s']:.1f} s, {len(rd['step_s'])} steps median {med:.3f} s "
        f"({shape.tokens / med:,.0f} tok/s) after warm-up {rd['warmup_s']:.1f} s, "
        f"loss {rd['loss_first']:.3f} -> {rd['loss_last']:.3f}, "
        f"peak {_gib(rd['peak_memory_bytes'])}"
    )
    held = rd["start_allocated_bytes"]
    if held is not None and held > 256 * 2**20:
        line += f" ({_gib(held)} of it allocated before the build)"
    return line


def problems_of(result: dict) -> list[str]:
    """What failed, was skipped or does not match (empty: all good)."""
    m = result["models"]
    out = [f"config: {x}" for x in m["config_mismatches"]]
    if m["tetrad_params"] != m["hf_params"]:
        out.append(f"parameters: tetrad {m['tetrad_params']:,}, hf {m['hf_params']:,}")
    for r in result["results"]:
        for side in SIDES:
            for i, rd in enumerate(r[side].get("rounds", [])):
                if "error" in rd:
                    out.append(f"{r['shape']} {r['variant']} {side} round {i + 1}: {rd['error']}")
    out += [f"skipped: {s}" for s in result["skipped"]]
    return out
