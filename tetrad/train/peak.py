"""The peak FLOP/s that MFU is measured against, and where it came from.

MFU = model FLOPs per second / (peak FLOP/s per rank x ranks) (Chowdhery et al., PaLM,
arXiv 2204.02311, appendix B). The peak per rank is, in this order:

1. ``--peak-flops`` when given;
2. the ``peak_tflops`` of a machine file written by ``tetrad calibrate`` (``--machine FILE``);
3. on CUDA, the GPU's datasheet dense bf16 figure (:data:`tetrad.device.GPU_PEAK_FLOPS`);
4. on CPU, measured: every rank at once (the load training puts on the cores) repeats the GEMM
   the model runs most, the SwiGLU up-projection of one micro-batch,
   ``[b S, h/G_x] x [h/G_x, ffn/G_y]`` in fp32, for the same window; the peak per rank is the
   ranks' mean throughput, the share of the host's GEMM rate one rank gets while all compute.

No datasheet bounds a CPU shared by several ranks, so a step may still run faster than the
measured peak; :class:`tetrad.train.metrics.StepMeter` then raises the peak to the rate the
step reached, so MFU never exceeds 100%.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tetrad.device import datasheet_flops, device_name
from tetrad.grid import Grid
from tetrad.models.config import ModelConfig
from tetrad.plan.machines import get_machine, preset_names
from tetrad.train.config import TrainConfig


@dataclass(frozen=True)
class Peak:
    """``flops``: peak FLOP/s of one rank (0: unknown); ``source``: what it is, one line."""

    flops: float
    source: str


def mfu_peak(cfg: TrainConfig, model_cfg: ModelConfig, grid: Grid) -> Peak:
    """The peak of the module docstring, the same on every rank (call on every rank).

    Raises:
        PlanError: ``--machine`` names an unreadable machine file.
    """
    if cfg.logging.peak_flops:
        return Peak(cfg.logging.peak_flops, "--peak-flops")
    machine = cfg.parallelism.machine
    if machine and machine not in preset_names():
        return Peak(get_machine(machine).peak_flops, f"machine file {machine}")
    if grid.device.type == "cuda":
        name = device_name(grid.device)
        return Peak(datasheet_flops(grid.device), f"{name} datasheet dense bf16")
    t = cfg.training
    rows = t.micro_batch * t.seq_len
    k, n = model_cfg.dim // grid.x, model_cfg.ffn_dim // grid.y
    dist.barrier()
    rate = torch.tensor(gemm_rate(rows, k, n), dtype=torch.float64)
    dist.all_reduce(rate)
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size))
    return Peak(
        float(rate) / grid.world_size,
        f"fp32 GEMM [{rows}x{k}]x[{k}x{n}] on {ranks} ranks at once, mean throughput",
    )


def gemm_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """FLOP/s of ``[m, k] x [k, n]`` in fp32 on the CPU (``2 m k n`` FLOPs each), repeated for
    about ``seconds`` with this process's threads: GEMMs done / wall time."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    done, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        done += 1
    return 2 * m * k * n * done / elapsed
