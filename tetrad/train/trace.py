"""Where a profiled step's device time went: a ``torch.profiler`` Chrome trace summarised.

``tetrad train --profile-steps A:B`` writes ``trace_steps_A-B.json`` (open it in Perfetto) and,
from it, ``trace_steps_A-B.txt``: the GPU kernels' time by category and the slowest kernels.
The categories tell compute-bound work (GEMMs, attention) from memory-bound work (element-wise
and reduction kernels, casts and copies), which is what stands between a step and its peak
FLOP/s.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

CATEGORIES = (
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),  # before gemm: cuDNN's
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|wgmma", re.I)),  # use wgmma
    ("collective", re.compile(r"nccl", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor", re.I)),
    ("fused (torch.compile)", re.compile(r"^triton", re.I)),
    ("copy / cast", re.compile(r"copy|memcpy|memset|cast|cat_|fill", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|cross_entropy|logsumexp|max_|sum_", re.I)),
    ("element-wise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
)
"""First match wins, on the kernel's name (cuBLAS, FlashAttention, NCCL, Inductor's Triton and
ATen's kernel names); what matches none is ``other``."""

DEVICE_EVENT_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """The :data:`CATEGORIES` name of a kernel ``name`` (``other`` when none matches)."""
    return next((cat for cat, rx in CATEGORIES if rx.search(name)), "other")


def device_events(trace: dict) -> list[tuple[str, float]]:
    """``(name, seconds)`` of every device event (kernels, copies, fills) of a Chrome trace."""
    events = trace.get("traceEvents", [])
    return [
        (e.get("name", "?"), float(e.get("dur", 0.0)) * 1e-6)
        for e in events
        if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENT_CATS
    ]


def breakdown(events: list[tuple[str, float]]) -> dict[str, float]:
    """Seconds of device time per category, largest first."""
    total: dict[str, float] = defaultdict(float)
    for name, seconds in events:
        total[category(name)] += seconds
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def top_kernels(events: list[tuple[str, float]], n: int = 15) -> list[tuple[str, int, float]]:
    """The ``n`` kernels with the most device time: ``(name, calls, seconds)``."""
    calls: dict[str, int] = defaultdict(int)
    seconds: dict[str, float] = defaultdict(float)
    for name, s in events:
        calls[name] += 1
        seconds[name] += s
    ranked = sorted(seconds, key=lambda k: -seconds[k])[:n]
    return [(k, calls[k], seconds[k]) for k in ranked]


def summary(trace_path: Path, steps: int, step_seconds: float | None = None) -> str:
    """The text summary of one trace of ``steps`` optimizer steps: per category the device
    seconds per step and the share of all device time (and of ``step_seconds``, the measured
    wall time of one step, when given), then the slowest kernels. Names are cut at 90
    characters."""
    events = device_events(json.loads(Path(trace_path).read_text()))
    if not events:
        return "no device kernels in the trace (CPU run): open it in Perfetto for the CPU ops\n"
    cats = breakdown(events)
    busy = sum(cats.values())
    lines = [f"device time per step: {busy / steps * 1e3:.1f} ms busy"]
    if step_seconds:
        lines[0] += (
            f" of {step_seconds * 1e3:.1f} ms wall ({100 * busy / steps / step_seconds:.0f}%)"
        )
    lines += ["", f"{'category':<24}{'ms/step':>10}{'share':>8}"]
    for cat, s in cats.items():
        lines.append(f"{cat:<24}{s / steps * 1e3:>10.1f}{100 * s / busy:>7.1f}%")
    lines += ["", f"{'kernel':<92}{'calls':>7}{'ms/step':>10}"]
    for name, n, s in top_kernels(events):
        lines.append(f"{name[:90]:<92}{n // steps:>7}{s / steps * 1e3:>10.2f}")
    return "\n".join(lines) + "\n"
