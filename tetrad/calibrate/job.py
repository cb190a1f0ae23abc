"""One calibration on every rank of a job: :func:`calibrate` (the per-rank entry point), and the
worker that ``tetrad calibrate`` starts in local processes (:func:`worker`, :class:`CalibrateJob`;
module-level so that spawned workers unpickle them by module path)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tetrad.calibrate.checks import CalibrationError, check_device, check_out, check_ranks
from tetrad.calibrate.describe import Run, describe
from tetrad.calibrate.machine_file import summary, write_machine_file
from tetrad.calibrate.measure import (
    measure_collectives,
    measure_compute,
    measure_overlap_slowdown,
)
from tetrad.calibrate.settings import settings
from tetrad.device import cpu_cores, local_device, threads_per_rank
from tetrad.grid import init_process_group


def calibrate(device: str = "cpu", out: str = "machine.toml", quick: bool = False) -> dict:
    """Measure this machine on every rank of a job and write a machine TOML (rank 0).

    Call on every rank; initialises the default process group from the ``torchrun``
    environment if none exists (NCCL for ``cuda``, gloo for ``cpu``;
    :func:`tetrad.grid.init_process_group`) and destroys it again at the end in that case. On
    CPU each rank uses :func:`tetrad.device.threads_per_rank` threads (``max(1, cpu_count //
    world)``). See :mod:`tetrad.calibrate` for what is measured and how the numbers are derived.

    Args:
        device: ``cpu`` or ``cuda``.
        out: the TOML file rank 0 writes (its folder must exist).
        quick: a few shapes and payloads (a few seconds; for tests).

    Returns:
        The machine description written, as a dict (same on every rank): the keys of
        :func:`tetrad.plan.machine.description.parse_machine` plus ``[sources]`` and the raw
        ``[calibration]`` data. Units: ``memory_gib`` GiB, ``peak_tflops`` TFLOP/s per rank,
        ``hbm_gbps`` and every bandwidth GB/s (1e9 bytes/s), latencies microseconds.

    Raises:
        CalibrationError: unknown device, CUDA asked for but absent, a single rank (nothing to
            measure the network with), or an output folder that is missing or not writable.
    """
    check_device(device)
    owned = init_process_group(device)
    try:
        return _calibrate(device, out, quick)
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _check_job(out: str) -> None:
    """Rank 0 checks the world size and the output folder; every rank raises its error.

    Raises:
        CalibrationError: a single rank, or an output folder that is missing or not writable.
    """
    err: list = [None]
    if dist.get_rank() == 0:
        try:
            check_ranks(dist.get_world_size())
            check_out(out)
        except CalibrationError as e:
            err = [str(e)]
    dist.broadcast_object_list(err, src=0)
    if err[0] is not None:
        raise CalibrationError(err[0])


def _calibrate(device: str, out: str, quick: bool) -> dict:
    """:func:`calibrate` inside the default process group."""
    _check_job(out)
    world = dist.get_world_size()
    dev = local_device(device)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        threads = threads_per_rank(world)
        torch.set_num_threads(threads)
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    run = Run(dev, out, quick, world, ranks_per_node, cpu_cores(), threads)
    s = settings(dev.type, quick)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    comp = measure_compute(dev, dtype, s)
    colls = measure_collectives(dev, s)
    if world > 1:
        shape = (512, 512, 512) if quick or dev.type == "cpu" else (4096, 4096, 4096)
        comp["overlap"] = measure_overlap_slowdown(dev, dtype, s, shape)

    result: list = [None]
    if dist.get_rank() == 0:
        machine = describe(run, comp, colls)
        machine["calibration"]["path"] = write_machine_file(machine, out)
        result = [machine]
    dist.broadcast_object_list(result, src=0)
    return result[0]


@dataclass(frozen=True)
class CalibrateJob:
    """What the workers of ``tetrad calibrate`` are asked to do (picklable; ``device`` is read
    by :func:`tetrad.train.launch.run_local` to set ``OMP_NUM_THREADS``)."""

    device: str
    out: str
    quick: bool


def worker(job: CalibrateJob) -> None:
    """Worker entrypoint of ``tetrad calibrate``: :func:`calibrate`, then the summary on rank 0.

    Raises:
        CalibrationError: as :func:`calibrate`.
    """
    result = calibrate(job.device, job.out, job.quick)
    if int(os.environ.get("RANK", "0")) == 0:
        print(summary(result), flush=True)
