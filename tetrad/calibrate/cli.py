"""``tetrad calibrate``'s options and what it runs (importing this module never imports torch:
the ``tetrad`` command builds its parser from :func:`add_arguments` and calls :func:`run`)."""

from __future__ import annotations

import argparse
import os
import sys

from tetrad.calibrate.checks import CalibrationError, check_device, check_out
from tetrad.spec.precision import DEVICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``tetrad calibrate`` to ``parser``: ``--device`` (default ``cpu``),
    ``--nproc`` (default None: the CUDA device count, or 4 on CPU), ``--out`` (default
    ``machine.toml``) and ``--quick``."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu (gloo, fp32 GEMMs) or cuda (NCCL, bf16 GEMMs)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="ranks to start (default: the CUDA device count, or 4 on CPU); ignored under torchrun",
    )
    parser.add_argument(
        "--out",
        default="machine.toml",
        metavar="FILE",
        help="machine TOML to write (default machine.toml)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="few shapes and payloads: seconds instead of a minute"
    )


def _nproc(device: str, nproc: int | None) -> int:
    """The number of local workers to start: ``nproc``, by default the CUDA device count (cuda)
    or 4 (cpu).

    Raises:
        CalibrationError: fewer than 2, or more than the visible GPUs on cuda.
    """
    from tetrad.device import gpu_count  # imports torch

    if nproc is None:
        nproc = gpu_count() if device == "cuda" else 4
    if nproc < 2:
        raise CalibrationError(
            f"--nproc {nproc}: calibrate needs at least 2 ranks to measure the network"
        )
    if device == "cuda" and gpu_count() < nproc:
        raise CalibrationError(f"--nproc {nproc} needs {nproc} GPUs, but {gpu_count()} are visible")
    return nproc


def run(args: argparse.Namespace) -> int:
    """Run ``tetrad calibrate`` with the options of :func:`add_arguments`: under ``torchrun``
    (``RANK`` and ``WORLD_SIZE`` set) calibrate in this process; otherwise start ``--nproc``
    local workers (:func:`tetrad.train.launch.run_local`).

    Returns:
        0 on success.

    Raises:
        CalibrationError: a mistake in the inputs (unknown or absent device, fewer than 2
            ranks, an output folder that is missing or not writable); the ``tetrad`` command
            prints it as one line ``tetrad: error: ...`` and exits with 2.
        SystemExit(1): a worker failed (from :func:`tetrad.train.launch.run_local`).
    """
    check_device(args.device)
    from tetrad.calibrate.job import CalibrateJob, worker

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(CalibrateJob(args.device, args.out, args.quick))
        return 0
    out = check_out(args.out)
    nproc = _nproc(args.device, args.nproc)
    from tetrad.train.launch import run_local

    print(f"tetrad: calibrating with {nproc} workers ({args.device})", file=sys.stderr, flush=True)
    run_local(CalibrateJob(args.device, out, args.quick), nproc, entrypoint=worker)
    return 0
