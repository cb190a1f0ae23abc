"""The input checks of ``tetrad calibrate`` and the error they raise (plain Python: importing
this module never imports torch; :func:`check_device` imports it when called)."""

from __future__ import annotations

import os

from tetrad.spec.errors import TetradError
from tetrad.spec.precision import DEVICES


class CalibrationError(TetradError):
    """A calibration that cannot run as asked (bad device, too few ranks, unwritable output)."""


def check_device(device: str) -> None:
    """Check that ``device`` is ``cpu`` or ``cuda`` and, for ``cuda``, that a GPU is visible.

    Raises:
        CalibrationError: an unknown device, or ``cuda`` without a visible CUDA device.
    """
    if device not in DEVICES:
        raise CalibrationError(f"device {device!r} is unknown: use cpu or cuda")
    if device == "cuda":
        from tetrad.device import gpu_count  # imports torch

        if not gpu_count():
            raise CalibrationError("--device cuda but no CUDA device is visible: use --device cpu")


def check_ranks(world: int) -> None:
    """Check that a job of ``world`` ranks can measure the network (at least 2 ranks).

    Raises:
        CalibrationError: fewer than 2 ranks.
    """
    if world < 2:
        raise CalibrationError(
            "calibrate needs at least 2 ranks to measure the network: use --nproc 2 or more"
        )


def check_out(out: str) -> str:
    """The absolute output path of ``out``.

    Raises:
        CalibrationError: its folder is missing or not writable.
    """
    path = os.path.abspath(out)
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise CalibrationError(
            f"output folder {folder!r} does not exist: create it or give another --out"
        )
    if not os.access(folder, os.W_OK):
        raise CalibrationError(f"output folder {folder!r} is not writable: give another --out")
    return path
