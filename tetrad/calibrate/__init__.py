"""``tetrad calibrate``: measure this machine and write a machine TOML for the planner.

Every rank of a job calls :func:`calibrate` (under ``torchrun``, or in the workers that
``tetrad calibrate`` starts with :func:`tetrad.train.launch.run_local`). It measures
(:mod:`~tetrad.calibrate.measure`, what exactly in :mod:`~tetrad.calibrate.settings`):

- **GEMMs** over square and skinny shapes (fp32 on CPU, bf16 on CUDA). Achieved FLOP/s per GEMM
  divided by a peak gives the ``[compute] gemm_efficiency`` table (fraction of peak vs FLOPs of
  one GEMM, median per half decade). CUDA: every rank times its own GPU at once (the slowest
  rank's figure is kept) and the peak is the datasheet figure; CPU: rank 0 times the GEMMs alone
  and the per-rank peak is its best rate shared among the ranks
  (:mod:`~tetrad.calibrate.describe`).
- **Memory bandwidth** (``hbm_gbps``): a large tensor copy, ``2 * bytes / time`` (CPU: rank 0
  alone, shared like the peak).
- **Attention** (``attention_efficiency``): causal ``scaled_dot_product_attention`` forward and
  backward, counted as the planner does (forward ``2 b S^2 d a``, backward 2.5x), over the peak.
- **Collectives**: all-reduce and all-gather of several payloads over groups laid out like the
  grid's axes. For each group size ``G > 1`` dividing the world and each stride ``s`` with
  ``s * G`` dividing the world, the world is split into the groups ``{base + i * s : i < G}``
  (``s = 1``: consecutive ranks, an inner axis such as X; larger ``s``: strided, an outer axis
  such as Z or data), and all groups run their collective at once, as an axis of the grid does.
  Per layout the alpha-beta ring model of :mod:`tetrad.plan.machine.network` is fitted (one bus
  bandwidth per layout, one ``alpha`` per kind), then the ``alpha`` values are fitted to
  ``latency_base + hops * latency_hop`` with the planner's hop counts
  (:mod:`~tetrad.calibrate.fit`).

Rank 0 writes the TOML (every number with its source in ``[sources]``, the raw measurements in
a ``[calibration]`` table that the planner ignores; :mod:`~tetrad.calibrate.machine_file`) and
every rank returns the same dict. Load the file with ``tetrad plan --machine FILE``
(:func:`tetrad.plan.machine.description.get_machine`).

The gloo backend emulates reduce-scatter with an all-reduce, and the planner sends every kind
of collective through one bandwidth, so reduce-scatter is not measured separately.

Modules: :mod:`~tetrad.calibrate.checks` (input checks, :class:`CalibrationError`),
:mod:`~tetrad.calibrate.settings`, :mod:`~tetrad.calibrate.measure`,
:mod:`~tetrad.calibrate.fit`, :mod:`~tetrad.calibrate.describe`,
:mod:`~tetrad.calibrate.machine_file`, :mod:`~tetrad.calibrate.job` (:func:`calibrate` and the
local worker) and :mod:`~tetrad.calibrate.cli` (the command's options). Importing this package
does not import torch; :func:`calibrate` is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tetrad.calibrate.checks import CalibrationError

if TYPE_CHECKING:
    from tetrad.calibrate.job import calibrate

__all__ = ["CalibrationError", "calibrate"]


def __getattr__(name: str) -> Any:
    """Load :func:`calibrate` (and torch with it) on first use."""
    if name == "calibrate":
        from tetrad.calibrate.job import calibrate

        return calibrate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
