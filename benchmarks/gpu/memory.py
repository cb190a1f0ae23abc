"""Part (c) of ``benchmarks/gpu_check.py``: the planner's predicted peak memory (``tetrad
memory --method tetrad``, run in this process) for the micro-batches of the training runs, the
largest micro-batch predicted to fit, and the prediction against each run's measured peak.
``benchmarks/gpu_memory.py`` uses :func:`memory_estimate` and :func:`device_memory_bytes`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex

import torch

from tetrad.device import total_memory_bytes
from tetrad.spec.units import GiB

from .common import GRID
from .profiles import Profile


def device_memory_bytes(device: str) -> int:
    """This GPU's memory (bytes); on CPU the host's physical memory."""
    if device == "cuda":
        return total_memory_bytes(torch.device("cuda", 0))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_estimate(
    model: str,
    micro_batch: int,
    seq_len: int,
    gpu_bytes: int,
    recompute: str = "none",
    compiled: bool = False,
    param_dtype: str = "fp32",
    residual_dtype: str = "auto",
) -> dict:
    """``tetrad memory --method tetrad --grid 1,1,1,1 --activation-checkpointing RECOMPUTE
    --param-dtype PARAM_DTYPE --residual-dtype RESIDUAL_DTYPE ... --json`` (and ``--compile``
    when ``compiled``; run in this process): the planner's breakdown (bytes) and verdict
    (``fits``: total <= 80% of ``gpu_bytes``)."""
    from tetrad.cli import main as tetrad_main

    argv = ["memory", "--method", "tetrad", "--grid", ",".join(map(str, GRID))]
    argv += ["--model", model, "--micro-batch", str(micro_batch)]
    argv += ["--activation-checkpointing", recompute]
    argv += ["--seq-len", str(seq_len), "--gpu-memory-gib", f"{gpu_bytes / GiB:.4f}", "--json"]
    argv += ["--compile"] if compiled else []
    argv += ["--param-dtype", param_dtype, "--residual-dtype", residual_dtype]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = tetrad_main(argv)
    if rc != 0:
        raise RuntimeError(f"tetrad {shlex.join(argv)} exited with {rc}")
    return json.loads(buf.getvalue())


def choose_micro_batch(args: argparse.Namespace, prof: Profile, gpu_bytes: int) -> dict:
    """The predicted memory of every candidate micro-batch and the largest that fits (or
    ``--micro-batch``)."""
    estimates = {
        mb: memory_estimate(args.model, mb, args.seq_len, gpu_bytes) for mb in prof.micro_batches
    }
    if args.micro_batch and args.micro_batch not in estimates:
        estimates[args.micro_batch] = memory_estimate(
            args.model, args.micro_batch, args.seq_len, gpu_bytes
        )
    fitting = [mb for mb, e in estimates.items() if e["fits"]]
    chosen = args.micro_batch or (max(fitting) if fitting else min(estimates))
    compiled = memory_estimate(args.model, chosen, args.seq_len, gpu_bytes, compiled=True)
    return {
        "chosen": chosen,
        "by_micro_batch": estimates,
        "compiled": {chosen: compiled},  # the --compile run's estimate (same micro-batch)
        "given": bool(args.micro_batch),
    }


def memory_part(choice: dict, training: dict | None, gpu_bytes: int) -> dict:
    """Predicted peak of the micro-batch used against the measured peak of each run (ratio
    measured / predicted; the ``compile`` run against ``tetrad memory --compile``)."""
    mb = training["micro_batch"] if training else choice["chosen"]
    est = choice["by_micro_batch"][mb]
    out = {
        "micro_batch": mb,
        "predicted_bytes": est["total_bytes"],
        "predicted_peak_phase": est.get("peak_phase"),
        "gpu_memory_bytes": gpu_bytes,
        "predicted_fraction": est["fraction"],
        "fit_fraction": est["fit_fraction"],
        "runs": {},
    }
    for name, run in (training or {}).get("runs", {}).items():
        if run.get("ok"):
            measured = run["peak_memory_bytes"]
            predicted = est["total_bytes"]
            if name == "compile" and mb in choice.get("compiled", {}):
                predicted = choice["compiled"][mb]["total_bytes"]
            out["runs"][name] = {
                "measured_bytes": measured,
                "predicted_bytes": predicted,
                "ratio": measured / predicted,
            }
    return out
