"""The peak FLOP/s that MFU is measured against, and where it came from.

MFU = model FLOPs per second / (peak FLOP/s per rank x ranks) (Chowdhery et al., PaLM,
arXiv 2204.02311, appendix B). The peak per rank is, in this order:

1. ``--peak-flops`` when given;
2. the ``peak_tflops`` of a machine file written by ``tetrad calibrate`` (``--machine FILE``);
3. on CUDA, the GPU's datasheet dense bf16 figure (:data:`tetrad.device.GPU_PEAK_FLOPS`);
4. on CPU, measured on the GEMM the model runs most, SwiGLU's fused gate/up projection of one
   micro-batch ``[b S, h/G_x] x [h/G_x, 2 ffn/G_y]`` in fp32: rank 0 times it with its threads
   while the other ranks wait (the best of repeats, so a busy moment does not lower it), and
   the peak per rank is that rate times the rank's share of the host's cores when every rank
   computes, ``min(1, cores / (ranks x threads))``.

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

from tetrad.device import cpu_cores, datasheet_flops, device_name
from tetrad.grid import Grid
from tetrad.models.config import ModelConfig
from tetrad.plan.machine.description import get_machine, preset_names
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
    k, n = model_cfg.dim // grid.x, 2 * model_cfg.ffn_dim // grid.y  # w13: gate and up
    ranks, threads = (
        int(os.environ.get("LOCAL_WORLD_SIZE", grid.world_size)),
        torch.get_num_threads(),
    )
    share = min(1.0, cpu_cores() / (ranks * threads))
    dist.barrier()
    rate = [gemm_rate(rows, k, n) if dist.get_rank() == 0 else 0.0]
    dist.broadcast_object_list(rate, src=0)
    return Peak(
        rate[0] * share,
        f"fp32 GEMM [{rows}x{k}]x[{k}x{n}] {rate[0] / 1e9:.1f} GFLOP/s on {threads} thread(s) "
        f"x {share:.2g} of the cores per rank ({ranks} ranks, {cpu_cores()} cores)",
    )


def gemm_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Best FLOP/s of ``[m, k] x [k, n]`` in fp32 on the CPU (``2 m k n`` FLOPs each) over
    repeats for about ``seconds``, with this process's threads."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best
