"""Peak memory and throughput of training steps on one GPU, against ``tetrad memory``.

    PYTHONPATH=. python benchmarks/gpu_memory.py [--out runs/gpu_memory] [--cases 1b,8b]
        [--modes none,selective,full] [--compile] [--micro-batches 4,8] [--param-dtypes fp32,bf16]
        [--residual-dtypes auto,fp32]

Each case (model, seq, micro-batch, recompute) runs in this process on the grid 1,1,1,1 (a
world of one, NCCL): ``ParallelLlama`` with that recompute mode, fused AdamW, global batch two
micro-batches under bf16 autocast, exactly :func:`tetrad.train.step.train_step` as ``tetrad
train --device cuda`` runs it, its weights built on the meta device and drawn on the GPU by
:func:`tetrad.parallel.init_parameters`, as ``tetrad train`` starts. Two warm-up steps (the
first allocates AdamW's states), then the peak is reset and ``--steps`` steps are timed between
two synchronisations.

Per case: measured peak (``torch.cuda.max_memory_allocated``, bytes) against the planner's
``tetrad memory --method tetrad --activation-checkpointing MODE`` (ratio measured/predicted),
tokens/s, and MFU = model FLOPs per token (:meth:`ModelSpec.flops_per_token`, no recompute
counted) x tokens/s / the datasheet dense bf16 peak (:func:`tetrad.device.datasheet_flops`).
Also per case, printed when it happens: ``start_to_first_step_s``, seconds from the start of
the model's construction to the end of its first step (construction, weights drawn, blocks
compiled, the first step with AdamW's state allocation and torch.compile's compilation), and
``process_start_to_first_step_s``, from this script's start (before torch's import; it includes
the cases before). A case out of memory is recorded as such (with the planner's figure) and the
next one runs.
The allocator runs with ``expandable_segments:True`` unless ``PYTORCH_CUDA_ALLOC_CONF`` is set
(the peak allocated is the same either way; fixed segments fragment near the card's limit).

Each case runs once per ``--param-dtypes`` entry (``tetrad train --param-dtype``: ``fp32``
weights, or ``bf16`` weights with fp32 masters in the optimizer, the prediction then ``tetrad
memory --param-dtype bf16``), and once per ``--residual-dtypes`` entry (``tetrad train
--residual-dtype``: ``auto``, the compute dtype, bf16 on CUDA; ``fp32``; the prediction with the
same option).

Cases ``1b``: llama-1b (vocabulary 32768), seq 2048, micro-batches 4 and 8 (or those of
``--micro-batches``), recompute none, selective and full. ``8b``: Llama-3.1-8B, seq 4096,
micro-batch 1, selective and full (needs the H200's 141 GB; the planner's verdict is printed
either way); ``--cases 8b,1b`` runs the 8b cases first. Writes ``OUT/gpu_memory.json`` and
``OUT/gpu_memory.md`` after each case (a run cut short keeps the cases it finished).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PROCESS_START = time.monotonic()
"""When this script started (``time.monotonic()``): before torch is imported."""

# Before CUDA starts: the 8b cases peak at 137.4 GiB of the H200's 139.8 and fail to allocate
# with the default allocator's fixed segments (fragmentation), as torchtitan's launcher also sets.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package gpu/ (gpu_check's parts)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu.common import world_of_one  # noqa: E402
from gpu.memory import device_memory_bytes, memory_estimate  # noqa: E402

from tetrad.device import datasheet_flops, device_name, peak_memory_bytes  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLlama, compile_blocks  # noqa: E402
from tetrad.spec.precision import precision  # noqa: E402
from tetrad.spec.presets import parse_model  # noqa: E402
from tetrad.spec.units import GiB  # noqa: E402
from tetrad.train.step import build_optimizer, train_step  # noqa: E402


@dataclass(frozen=True)
class Case:
    """One measurement: ``model`` as ``tetrad train --model`` takes it."""

    model: str
    seq_len: int
    micro_batch: int
    recompute: str
    param_dtype: str = "fp32"
    residual_dtype: str = "auto"


MODES = ("none", "selective", "full")


def cases(
    key: str,
    micro_batches: list[int] | None,
    param_dtypes: list[str],
    residual_dtypes: tuple[str, ...] = ("auto",),
) -> list[Case]:
    """The cases of ``key`` (``1b``, ``8b`` or ``tiny``), each in every format of
    ``param_dtypes`` and ``residual_dtypes``; ``micro_batches`` replaces the 1b cases' 4 and 8,
    and filters the others'.

    Raises:
        KeyError: an unknown ``key``."""
    if key == "1b":
        base = [
            Case("llama-1b,vocab_size=32768", 2048, mb, mode)
            for mb in (micro_batches or (4, 8))
            for mode in MODES
        ]
    else:
        base = {
            "8b": [Case("llama-3.1-8b,vocab_size=128256", 4096, 1, m) for m in MODES[1:]],
            "tiny": [Case("tiny", 64, 2, m) for m in MODES],  # CPU smoke test
        }[key]
        base = [c for c in base if not micro_batches or c.micro_batch in micro_batches]
    return [
        Case(**{**c.__dict__, "param_dtype": d, "residual_dtype": r})
        for c in base
        for d in param_dtypes
        for r in residual_dtypes
    ]


def run_case(grid, case: Case, steps: int, gpu_bytes: int, compiled: bool = False) -> dict:
    """Measure one case (``compiled``: every block under ``torch.compile``, as ``tetrad train
    --compile``); frees its model and optimizer afterwards."""
    est = memory_estimate(
        case.model,
        case.micro_batch,
        case.seq_len,
        gpu_bytes,
        case.recompute,
        compiled,
        case.param_dtype,
        case.residual_dtype,
    )
    out = {**case.__dict__, "compiled": compiled}
    out |= {"predicted_bytes": est["total_bytes"], "fits": est["fits"]}
    out["predicted_peak_phase"] = est.get("peak_phase")
    cfg, _ = parse_model(case.model)
    model = opt = None
    try:
        t_start = time.perf_counter()
        model = ParallelLlama(cfg, grid, case.recompute)
        init_parameters(model, 0, grid)
        if compiled:
            compile_blocks(model)
        policy = precision(grid.device.type, case.param_dtype, residual=case.residual_dtype)
        opt = build_optimizer(model, 3e-4, 0.1, policy=policy)
        gen = torch.Generator().manual_seed(0)
        shape = (2 * case.micro_batch, case.seq_len + 1)
        batch = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        train_step(model, opt, grid, batch, case.micro_batch, 1.0)
        sync(grid.device)
        first_step_s = time.perf_counter() - t_start
        out["start_to_first_step_s"] = first_step_s
        out["process_start_to_first_step_s"] = time.monotonic() - PROCESS_START
        print(
            f"gpu_memory: {case.model.split(',')[0]} {case.recompute}: model construction to "
            f"the end of the first step {first_step_s:.1f} s",
            flush=True,
        )
        train_step(model, opt, grid, batch, case.micro_batch, 1.0)
        sync(grid.device)
        if grid.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss, _ = train_step(model, opt, grid, batch, case.micro_batch, 1.0)
        sync(grid.device)
        seconds = (time.perf_counter() - t0) / steps
        tokens = shape[0] * case.seq_len
        measured = peak_memory_bytes(grid.device)
        peak = datasheet_flops(grid.device) or float("nan")
        out |= {
            "ok": True,
            "loss": float(loss),
            "measured_bytes": measured,
            "ratio": measured / est["total_bytes"],
            "step_s": seconds,
            "tokens_per_s": tokens / seconds,
            "mfu": cfg.flops_per_token(case.seq_len) * tokens / seconds / peak,
        }
    except torch.OutOfMemoryError as e:
        out |= {"ok": False, "error": "out of memory: " + str(e).splitlines()[0][:160]}
    finally:
        del model, opt
        gc.collect()
        if grid.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(rows: list[dict], name: str, gpu_bytes: int) -> str:
    """The table of every case."""
    head = (
        f"# gpu_memory: {name}, {gpu_bytes / GiB:.1f} GiB, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}\n\n"
        "| model | seq | micro-batch | recompute | weights, stream | predicted | measured peak | "
        "measured / predicted | step | tokens/s | MFU | start to first step |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        pred = f"{r['predicted_bytes'] / GiB:.2f} GiB ({'fits' if r['fits'] else 'over 80%'})"
        first = r.get("start_to_first_step_s")
        first_cell = "" if first is None else f"{first:.1f} s"
        if not r["ok"]:
            cells = [r["error"], "", "", "", "", first_cell]
        else:
            cells = [
                f"{r['measured_bytes'] / GiB:.2f} GiB",
                f"{r['ratio']:.3f}",
                f"{r['step_s']:.3f} s",
                f"{r['tokens_per_s']:,.0f}",
                f"{100 * r['mfu']:.1f}%",
                first_cell,
            ]
        mode = r["recompute"] + (" + compile" if r.get("compiled") else "")
        row = [r["model"].split(",")[0], str(r["seq_len"]), str(r["micro_batch"]), mode]
        row.append(f"{r.get('param_dtype', 'fp32')}, {r.get('residual_dtype', 'auto')}")
        lines.append("| " + " | ".join(row + [pred] + cells) + " |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the cases of ``--cases`` in order; write and print the table. Returns 0 (a case out
    of memory is a result, not a failure)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_memory")
    p.add_argument("--cases", default="1b,8b", help="comma-separated, run in this order: 1b, 8b")
    p.add_argument("--steps", type=int, default=3, help="timed steps per case")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: smoke test")
    p.add_argument("--modes", default="none,selective,full", help="recompute modes to run")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument(
        "--micro-batches", help="comma-separated: the 1b cases' micro-batches (others: a filter)"
    )
    p.add_argument(
        "--param-dtypes", default="fp32", help="comma-separated weight formats: fp32, bf16"
    )
    p.add_argument(
        "--residual-dtypes", default="auto", help="comma-separated stream formats: auto, fp32"
    )
    args = p.parse_args(argv)
    mbs = [int(m) for m in args.micro_batches.split(",")] if args.micro_batches else None
    dtypes = args.param_dtypes.split(",")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible: use --device cpu --cases tiny")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu_bytes = device_memory_bytes(args.device)
    rows: list[dict] = []
    with world_of_one(args.device) as grid:
        name = device_name(grid.device)
        for key in args.cases.split(","):
            for case in cases(key, mbs, dtypes, tuple(args.residual_dtypes.split(","))):
                if case.recompute not in args.modes.split(","):
                    continue
                rows.append(run_case(grid, case, args.steps, gpu_bytes, args.compile))
                print(json.dumps(rows[-1]), flush=True)
                text = write(out, rows, name, gpu_bytes)  # after each case: a cut run keeps it
    print(text if rows else "gpu_memory: no case selected", flush=True)
    return 0


def write(out: Path, rows: list[dict], name: str, gpu_bytes: int) -> str:
    """Write ``gpu_memory.json`` and ``gpu_memory.md`` of the cases so far; return the table."""
    (out / "gpu_memory.json").write_text(json.dumps(rows, indent=2) + "\n")
    text = markdown(rows, name, gpu_bytes)
    (out / "gpu_memory.md").write_text(text)
    return text


if __name__ == "__main__":
    sys.exit(main())
