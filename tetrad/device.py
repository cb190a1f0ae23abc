"""The few device-specific calls tetrad needs (the only place ``torch.cuda`` is used)."""

from __future__ import annotations

import os
import resource

import torch

# Dense bf16 peak FLOP/s per GPU from the vendors' datasheets (without sparsity).
GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
}


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_device(device_type: str) -> torch.device:
    """This process's device: ``cuda:LOCAL_RANK`` (made current) for CUDA, else ``cpu``."""
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(ranks: int) -> int:
    """Threads for each of ``ranks`` CPU processes of one host so that they share its cores:
    ``max(1, cpu_count // ranks)`` (the value of ``OMP_NUM_THREADS`` for local workers)."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


def cpu_threads(ranks: int) -> int:
    """Threads for one of ``ranks`` CPU processes of one host: ``OMP_NUM_THREADS`` when set (a
    positive integer; what the user, ``tetrad train``'s launcher or ``torchrun`` chose), else
    :func:`threads_per_rank`."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) >= 1:
        return int(text)
    return threads_per_rank(ranks)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (for timing measurements only, never in training)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def total_memory_bytes(device: torch.device) -> int:
    """The GPU's memory in bytes (0 for a CPU)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process in bytes: ``torch.cuda.max_memory_allocated`` on CUDA, the
    resident-set high-water mark (``ru_maxrss``) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def datasheet_flops(device: torch.device) -> float:
    """The GPU's dense bf16 peak FLOP/s from :data:`GPU_PEAK_FLOPS` (0 for an unknown GPU or a
    CPU: see :mod:`tetrad.train.peak` for how a CPU's peak is measured)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_PEAK_FLOPS.items() if k in name), 0.0)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
