"""The machine TOML that ``tetrad calibrate`` writes (plain Python): the TOML text, the atomic
write after checking that the planner accepts it, and the summary printed at the end.

Load the file with ``tetrad plan --machine FILE``
(:func:`tetrad.plan.machine.description.get_machine`).
"""

from __future__ import annotations

import os

import tomli_w

from tetrad.calibrate.checks import check_out
from tetrad.plan.machine.description import parse_machine
from tetrad.spec.toml import tomllib

HEADER = (
    "Machine description measured by `tetrad calibrate` (tetrad/calibrate).\n"
    "Use: tetrad plan --machine FILE ...   Sources of every number: [sources].\n"
    "[calibration] holds the raw measurements (the planner ignores it)."
)
"""The comment at the top of every machine file ``tetrad calibrate`` writes."""


def to_toml(d: dict, header: str = "") -> str:
    """A TOML document of ``d`` (written by ``tomli_w``) under ``header`` as comments."""
    lines = [f"# {h}" if h else "#" for h in header.splitlines()]
    return "\n".join(lines) + ("\n" if lines else "") + tomli_w.dumps(d)


def write_machine_file(machine: dict, out: str) -> str:
    """Write ``machine`` (as from :func:`tetrad.calibrate.describe.describe`) to ``out`` as
    TOML under :data:`HEADER`, atomically (a temporary file renamed over ``out``), after
    checking that the planner parses it (:func:`tetrad.plan.machine.description.parse_machine`,
    named after the file's stem). Returns the absolute path written.

    Raises:
        CalibrationError: the folder of ``out`` is missing or not writable.
    """
    path = check_out(out)
    text = to_toml(machine, header=HEADER)
    stem = os.path.splitext(os.path.basename(path))[0]
    parse_machine(tomllib.loads(text), stem)  # the planner must accept what we write
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def summary(result: dict) -> str:
    """A few lines on what :func:`tetrad.calibrate.calibrate` found (for rank 0 to print)."""
    cal, net, comp = result["calibration"], result["network"], result["compute"]
    best = max(cal["gemm"], key=lambda g: g["gflops"])
    eff = comp["gemm_efficiency"]
    lines = [
        f"tetrad calibrate: {cal['world']} ranks, {result['gpu']}",
        f"  GEMM: best {best['gflops']:.4g} GFLOP/s ({best['m']}x{best['n']}x{best['k']}); "
        f"peak {result['peak_tflops'] * 1e3:.4g} GFLOP/s per rank; efficiency "
        f"{eff[0][1]:.2f} at {eff[0][0]:.2g} FLOPs .. {eff[-1][1]:.2f} at {eff[-1][0]:.2g}",
        f"  attention efficiency {comp['attention_efficiency']:.2f}; memory "
        f"{result['hbm_gbps']:.4g} GB/s per rank",
        "  collectives (bus bandwidth; alpha per call):",
    ]
    for f in cal["fits"]:
        where = "inner" if f["stride"] == 1 else "outer"
        lines.append(
            f"    G={f['members']} stride={f['stride']} ({where}): {f['gbps']:.4g} GB/s, "
            f"all-reduce {f.get('alpha_all_reduce_us', 0.0):.4g} us, "
            f"all-gather {f.get('alpha_all_gather_us', 0.0):.4g} us"
        )
    lines.append(
        f"  latency: {net['latency_base_us']:.4g} us + {net['latency_hop_intra_us']:.4g} "
        "us per ring step"
    )
    lines.append(f"  wrote {cal.get('path', result['name'])} (use: tetrad plan --machine FILE ...)")
    return "\n".join(lines)
