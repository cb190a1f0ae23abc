"""Part (d) of ``benchmarks/gpu_check.py``: the planner's predicted step time against the
measured one. ``tetrad calibrate --quick`` writes a machine file where it can (two ranks); the
device's compute is also measured in-process; the prediction
(:func:`tetrad.plan.step_time.estimate`) runs on the calibrated machine, on the preset with
the measured compute and on the bare preset."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path

import torch

from tetrad.device import cpu_cores, device_name
from tetrad.plan.machine.description import Machine, get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import estimate
from tetrad.spec.precision import DTYPE_BYTES, compute_dtype
from tetrad.spec.presets import parse_model
from tetrad.spec.units import GiB

from .common import GRID, run_logged, say

PRESET_FALLBACK = "dgx-h100"
"""The machine preset of an unknown GPU, and of the CPU."""
GPU_PRESETS = {"H200": "h200-node", "H100": "dgx-h100", "A100": "dgx-a100-80gb"}
"""A part of the device's name -> the machine preset of the planner."""


def measure_compute_figures(device: torch.device) -> dict:
    """This device's compute measured as ``tetrad calibrate --quick`` measures it (GEMMs,
    memory copy, attention; :func:`tetrad.calibrate.measure.measure_compute`), turned into the
    machine file's compute figures (``memory_gib`` GiB, ``peak_tflops`` TFLOP/s, ``hbm_gbps``
    GB/s, ``compute``) by :func:`tetrad.calibrate.describe.compute_figures`. Call inside a
    process group."""
    from tetrad.calibrate.describe import Run, compute_figures
    from tetrad.calibrate.measure import measure_compute
    from tetrad.calibrate.settings import settings

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comp = measure_compute(device, dtype, settings(device.type, quick=True))
    run = Run(device, "in-process", True, 1, 1, cpu_cores(), torch.get_num_threads())
    figures, sources = compute_figures(run, comp, device_name(device), "gpu_check in-process")
    return {"figures": figures, "sources": sources}


def calibrate_part(args: argparse.Namespace, deadline: float) -> dict:
    """``tetrad calibrate --device DEV --quick`` into ``OUT/machine.toml`` (two ranks on CPU;
    on CUDA the default, one rank per visible GPU): the command, exit status and output."""
    path = Path(args.out) / "machine.toml"
    path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "tetrad.cli", "calibrate", "--device", args.device, "--quick"]
    cmd += ["--out", str(path)] + (["--nproc", "2"] if args.device == "cpu" else [])
    log = Path(args.out) / "calibrate.log"
    say(f"(d) {shlex.join(cmd[1:])}")
    rc, wall = run_logged(cmd, log, min(300.0, max(30.0, deadline - time.monotonic())))
    lines = log.read_text(errors="replace").splitlines()
    ok = rc == 0 and path.is_file()
    return {
        "command": shlex.join(cmd),
        "rc": rc,
        "wall_s": wall,
        "ok": ok,
        "machine_file": str(path) if ok else None,
        "output_tail": lines[-12:],
    }


def preset_name(device: str) -> str:
    """The machine preset of this GPU (``dgx-h100`` when unknown, and on CPU)."""
    name = device_name(torch.device("cuda", 0)) if device == "cuda" else ""
    return next((m for key, m in GPU_PRESETS.items() if key in name), PRESET_FALLBACK)


def with_measured_compute(preset: Machine, figures: dict) -> Machine:
    """``preset`` with its compute figures (peak, memory, HBM bandwidth, GEMM and attention
    efficiencies) replaced by the ones measured here."""
    table = sorted((float(f), float(e)) for f, e in figures["compute"]["gemm_efficiency"])
    if len(table) == 1:
        table.append((table[0][0] * 10, table[0][1]))
    return dataclasses.replace(
        preset,
        name=f"{preset.name}+measured-compute",
        memory_bytes=int(figures["memory_gib"] * GiB),
        peak_flops=figures["peak_tflops"] * 1e12,
        hbm_bytes_per_s=figures["hbm_gbps"] * 1e9,
        gemm_table=tuple(table),
        attention_efficiency=figures["compute"]["attention_efficiency"],
    )


def predict_step(machine: Machine, args: argparse.Namespace, mb: int) -> dict:
    """The planner's predicted step (seconds) of this run on ``machine``:
    ``tetrad.plan.step_time.estimate(StepQuestion(model, machine, seq_len, global_batch), grid,
    micro_batch, checkpointing=False)`` with every overlap on, as ``tetrad train`` runs."""
    cfg, _ = parse_model(args.model)
    ctx = StepQuestion(
        cfg,
        machine,
        args.seq_len,
        2 * mb,
        overlaps="all",
        compute_bytes=DTYPE_BYTES[compute_dtype(args.device)],
    )
    est = estimate(ctx, GRID, mb, False)
    return {
        "step_s": est.step_s,
        "compute_s": est.compute_s,
        "exposed_comm_s": sum(est.exposed_s.values()),
    }


def planner_part(
    args: argparse.Namespace, calib: dict, figures: dict | None, mb: int, training: dict | None
) -> dict:
    """Predicted step time on each machine (calibrated file, preset with measured compute,
    preset) against each run's measured median step (ratio measured / predicted)."""
    preset = get_machine(preset_name(args.device))
    machines = []
    if calib["ok"]:
        machines.append(("calibrated", get_machine(calib["machine_file"])))
    if figures is not None:
        measured = with_measured_compute(preset, figures["figures"])
        machines.append(("preset with compute measured here", measured))
    machines.append(("preset", preset))
    preds = []
    for source, machine in machines:
        p = predict_step(machine, args, mb) | {"machine": machine.name, "source": source}
        p["measured"] = {}
        for name, run in (training or {}).get("runs", {}).items():
            if run.get("ok"):
                ratio = run["step_time_s"] / p["step_s"]
                p["measured"][name] = {"step_time_s": run["step_time_s"], "ratio": ratio}
        preds.append(p)
    notes = []
    if not calib["ok"]:
        notes.append(
            f"tetrad calibrate did not run here ({' '.join(calib['output_tail'][-1:])}): "
            f"fell back to the {preset.name} preset, bare and with this device's compute "
            "measured in-process"
        )
    if figures is None:
        notes.append("the in-process compute measurement failed (see errors)")
    note = "; ".join(notes) or None
    api = (
        "tetrad.plan.step_time.estimate(tetrad.plan.question.StepQuestion(...), grid, "
        "micro_batch, False)"
    )
    return {"api": api, "calibrate": calib, "predictions": preds, "note": note}
