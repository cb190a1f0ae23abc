"""Byte units, defined once for the runtime and the planner (plain Python)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
"""Binary units for memory and buffer sizes. Bandwidths are decimal: GB/s = 1e9 bytes/s."""

FP32 = 4
"""Bytes of an fp32 element: master weights, gradients, optimizer states, norm and loss
statistics."""
