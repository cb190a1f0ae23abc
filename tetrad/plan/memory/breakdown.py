"""The :class:`MemoryBreakdown` both memory estimators give (bytes per component, the peak phase)
and the 80% verdict of Fujii, Watanabe and Yokota (arXiv 2411.06465, abstract: "when the
estimated memory is below 80% of available GPU memory, training never ran out of memory").
Plain Python."""

from __future__ import annotations

from dataclasses import dataclass, field

from tetrad.plan.errors import PlanError
from tetrad.spec.units import GiB

FIT_FRACTION = 0.8
"""Fujii et al. (arXiv 2411.06465): an estimate at or below 80% of GPU memory never ran out of
memory in their 454 runs; the 20% covers CUDA context, communicator buffers, allocator
fragmentation and other temporaries."""


@dataclass
class MemoryBreakdown:
    """Bytes per component on the most loaded rank, at its peak moment.

    Attributes:
        components: bytes per component (``parameters``, ``gradients``, ``optimizer_states``,
            ``activations``, ...); they add up to :attr:`total`.
        gpu_memory_bytes: the GPU's memory in bytes.
        peak_phase: for :func:`tetrad.plan.memory.runtime.runtime_memory`, the phase of the training
            step at which the rank peaks (components not alive then are 0); empty for
            :func:`tetrad.plan.memory.fujii.fujii2024`.
        phases: for :func:`tetrad.plan.memory.runtime.runtime_memory`, the total bytes at each phase
            considered.
    """

    components: dict[str, float]
    gpu_memory_bytes: float
    peak_phase: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Sum of the components (bytes)."""
        return float(sum(self.components.values()))

    @property
    def fraction(self) -> float:
        """``total / gpu_memory_bytes``."""
        return self.total / self.gpu_memory_bytes if self.gpu_memory_bytes else float("inf")

    @property
    def fits(self) -> bool:
        """``total <= 0.8 * gpu_memory_bytes`` (Fujii et al., arXiv 2411.06465)."""
        return self.total <= FIT_FRACTION * self.gpu_memory_bytes

    def to_dict(self) -> dict:
        """Plain-JSON view: components and totals in bytes and GiB, the fraction and verdict."""
        out = {
            "components_bytes": {k: float(v) for k, v in self.components.items()},
            "components_gib": {k: v / GiB for k, v in self.components.items()},
            "total_bytes": self.total,
            "total_gib": self.total / GiB,
            "gpu_memory_bytes": float(self.gpu_memory_bytes),
            "fraction": self.fraction,
            "fit_fraction": FIT_FRACTION,
            "fits": self.fits,
        }
        if self.peak_phase:
            out["peak_phase"] = self.peak_phase
            out["phases_bytes"] = {k: float(v) for k, v in self.phases.items()}
        return out


def check_positive(**sizes: int) -> None:
    """Raise :class:`PlanError` unless every value is a positive integer (the message names it)."""
    for k, v in sizes.items():
        if int(v) != v or v < 1:
            raise PlanError(f"{k}={v} must be a positive integer")
