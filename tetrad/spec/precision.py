"""The numeric-format policy: devices and their compute dtype (plain Python)."""

from __future__ import annotations

from typing import Literal

from tetrad.spec.units import FP32

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
"""``cpu`` runs on gloo in fp32; ``cuda`` on NCCL with bf16 autocast."""

DTYPE_BYTES = {"bf16": 2, "fp32": FP32}
"""Compute-dtype bytes. ``"bf16"`` is the runtime on CUDA (bf16 autocast, fp32 master weights,
FlashAttention-style SDPA, foreach AdamW); ``"fp32"`` the runtime on CPU (no autocast, the CPU
flash SDPA kernel, single-tensor AdamW)."""


def compute_dtype(device: str) -> str:
    """The compute dtype of the runtime on ``device``: ``bf16`` on CUDA, ``fp32`` on CPU."""
    return "bf16" if device == "cuda" else "fp32"
