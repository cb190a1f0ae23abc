"""Part (e) of ``benchmarks/gpu_check.py``: the Markdown report (a header and one table of
every figure, then each run's profile) and the list of problems (what failed or did not run)."""

from __future__ import annotations

from tetrad.spec.units import GiB


def _e(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def _s(x: float) -> str:
    return f"{x:.3g} s"


def fmt_gib(x: float) -> str:
    """``x`` bytes in GiB, two decimals."""
    return f"{x / GiB:.2f} GiB"


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def equivalence_rows(eq: dict) -> list[list[str]]:
    """Table rows of part (a)."""
    rows = []
    for r in eq["layers"]:
        rows.append(
            [
                r["check"],
                r["precision"],
                f"worst rel-norm {_e(r['worst'])} ({r['worst_tensor']})",
                f"<= {r['tolerance']:.0e}",
                _verdict(r["passed"]),
            ]
        )
    for r in eq["runs"]:
        tol = r["tolerance"]
        rows.append(
            [
                f"{r['check']} ({r['model']}, {r['batch']}x{r['seq_len']})",
                r["mode"]
                + (f" ({r['precision']})" if r["mode"] != r["precision"] else "")
                + (", compiled" if r["compiled"] else ""),
                f"loss rel {_e(r['loss_rel'])}; grad rel-norm worst "
                f"{_e(r['grad_rel_norm_worst'])} ({r['worst_param']}), all "
                f"{_e(r['grad_rel_norm_global'])}"
                + (
                    f"; grad norm rel {_e(r['grad_norm_rel'])}"
                    if r["grad_norm_rel"] is not None
                    else ""
                ),
                f"loss <= {tol['loss_rel']:.0e}, grads <= {tol['tensor_rel']:.0e}",
                _verdict(r["passed"]),
            ]
        )
    for r in eq.get("resume", []):
        if "error" in r:
            rows.append([r["check"], r["policy"], r["error"], "runs", _verdict(False)])
            continue
        rows.append(
            [
                r["check"],
                r["policy"],
                f"loss rel {_e(r['loss_rel'])}; weights rel-norm worst "
                f"{_e(r['weight_rel_norm_worst'])}",
                f"loss <= {r['tolerance']['loss_rel']:.0e}, weights <= "
                f"{r['tolerance']['weight_rel']:.0e}",
                _verdict(r["passed"]),
            ]
        )
    stats = eq["compile_stats"]
    rows.append(
        [
            "torch.compile in-process",
            "compile_blocks",
            f"{stats['graphs']} graphs, {stats['graph_breaks']} graph breaks",
            "",
            "",
        ]
    )
    return rows


def training_rows(result: dict) -> list[list[str]]:
    """Table rows of parts (b) and (c)."""
    tr, mem = result.get("training"), result["memory"]
    rows = [
        [
            "memory estimate (tetrad memory)",
            f"micro-batch {mem['micro_batch']}, seq {result['settings']['seq_len']}",
            f"{fmt_gib(mem['predicted_bytes'])} ({100 * mem['predicted_fraction']:.0f}% of "
            f"{fmt_gib(mem['gpu_memory_bytes'])})",
            f"fits below {100 * mem['fit_fraction']:.0f}%",
            "",
        ]
    ]
    for name, run in (tr or {}).get("runs", {}).items():
        setting = f"{result['settings']['model']}, micro-batch {run['micro_batch']}"
        if not run["ok"]:
            rows.append([f"train {name}", setting, run.get("error", "failed"), "", "FAIL"])
            continue
        measured = (
            f"{run['tokens_per_s']:,.0f} tok/s, MFU {100 * run['mfu']:.1f}%, "
            f"{_s(run['step_time_s'])}/step, peak {fmt_gib(run['peak_memory_bytes'])}, "
            f"first {result['settings']['log_every']} steps {_s(run['first_interval_s'])}"
        )
        if run.get("compile_line"):
            measured += f"; {run['compile_line'].removeprefix('tetrad: ')}"
        rows.append([f"train {name}", setting, measured, "", "ok"])
        m = mem["runs"].get(name)
        if m:
            rows.append(
                [
                    f"memory measured / predicted ({name})",
                    "the run's peak_memory_bytes",
                    f"{fmt_gib(m['measured_bytes'])} / "
                    f"{fmt_gib(m.get('predicted_bytes', mem['predicted_bytes']))} = "
                    f"{m['ratio']:.2f}",
                    "about 1"
                    if result["environment"]["device"] == "cuda"
                    else "none: on CPU the peak is the process's RSS",
                    "",
                ]
            )
    return rows


def planner_rows(pl: dict) -> list[list[str]]:
    """Table rows of part (d)."""
    cal = pl["calibrate"]
    status = "ok" if cal["ok"] else "fallback"
    rows = [
        [
            "tetrad calibrate --quick",
            f"rc {cal['rc']}",
            (pl["note"] or "machine file written"),
            "",
            status,
        ]
    ]
    for p in pl["predictions"]:
        measured = "; ".join(
            f"{name} {_s(m['step_time_s'])} = {m['ratio']:.3g}x predicted"
            for name, m in p["measured"].items()
        )
        rows.append(
            [
                "step time: planner vs measured",
                f"{p['machine']} ({p['source']})",
                f"predicted {_s(p['step_s'])} (compute {_s(p['compute_s'])})"
                + (f"; measured {measured}" if measured else ""),
                "",
                "",
            ]
        )
    return rows


def markdown(result: dict) -> str:
    """The Markdown report: a header and one table of every figure."""
    env = result["environment"]
    head = (
        f"# tetrad gpu_check: {env['device_name']} ({env['device']})\n\n"
        f"torch {env['torch']}, Python {env['python']}, {env['started']}, "
        f"{env['wall_s']:.0f} s; result: {'ok' if result['ok'] else 'PROBLEMS'}\n\n"
    )
    rows = []
    if result.get("equivalence"):
        rows += equivalence_rows(result["equivalence"])
    if result.get("memory"):
        rows += training_rows(result)
    if result.get("planner"):
        rows += planner_rows(result["planner"])
    table = ["| check | setting | measured | expected | result |", "|---|---|---|---|---|"]
    table += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]
    problems = "".join(f"\n- {p}" for p in result["problems"])
    text = head + "\n".join(table) + ("\n\nProblems:" + problems if problems else "") + "\n"
    for name, run in (result.get("training") or {}).get("runs", {}).items():
        if run.get("profile"):
            text += f"\n## Profile of the {name} run (tetrad.train.trace)\n\n```\n"
            text += run["profile"] + "```\n"
    return text


def problems_of(result: dict) -> list[str]:
    """What failed or did not run (empty: all good)."""
    out = []
    eq = result.get("equivalence")
    if eq is not None:
        out += [
            f"equivalence failed: {r['check']} {r['precision']}"
            for r in eq["layers"]
            if not r["passed"]
        ]
        out += [
            f"equivalence failed: model {r['mode']}{' compiled' if r['compiled'] else ''}"
            for r in eq["runs"]
            if not r["passed"]
        ]
        out += [f"resume failed: {r['policy']}" for r in eq.get("resume", []) if not r["passed"]]
    for name, run in (result.get("training") or {}).get("runs", {}).items():
        if not run["ok"]:
            out.append(f"training {name} failed: {run.get('error')}")
    for part, err in result.get("errors", {}).items():
        out.append(f"{part} raised: {err.splitlines()[-1] if err else ''}")
    return out
