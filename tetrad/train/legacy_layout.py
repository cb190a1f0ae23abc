"""Checkpoints written before SwiGLU's ``w13`` was stacked: read them in today's layout.

Until commit d25e0c3 ``w13`` was one ``[2f, h]`` tensor whose rows interleaved gate and up
(``gate_0, up_0, gate_1, up_1, ...``); it is now ``[2, f, h]``, gate and up stacked
(:attr:`tetrad.parallel.placement.Placement.stacked`). A checkpoint tells the two apart by
the saved shape alone: a stacked weight saved with two dims is the old layout. Its rows
``[2a, 2b)`` are gate and up rows ``[a, b)``, and the old runtime's shard of a rank was exactly
the rows ``[2a, 2b)`` whose gate and up rows ``[a, b)`` the rank holds now, so each rank reads
its old rows (the old placement) and de-interleaves them locally.
"""

from __future__ import annotations

import torch

from tetrad.parallel.placement import Placement


def is_interleaved(placement: Placement, saved_shape: tuple[int, ...]) -> bool:
    """Whether a tensor saved as ``saved_shape`` for a parameter of ``placement`` is the old
    interleaved ``[2f, h]`` of a stacked ``[2, f, h]`` weight."""
    return placement.stacked and len(saved_shape) == len(placement.shape) - 1


def interleaved_placement(placement: Placement) -> Placement:
    """The old placement of a stacked weight: ``[2f, h]``, rows split as the stacked rows are."""
    s, f, *rest = placement.shape
    return Placement((s * f, *rest), placement.split[1:], placement.sum_axes)


def stacked_from_interleaved(rows: torch.Tensor) -> torch.Tensor:
    """``[2n, ...]`` interleaved rows (gate, up, gate, up, ...) -> ``[2, n, ...]`` stacked (a
    copy)."""
    return rows.unflatten(0, (-1, 2)).transpose(0, 1).contiguous()


STACKED_NAMES = ("feed_forward.w13.weight", "shared.w13.weight")
"""Parameter name endings of the stacked weights (the dense SwiGLU's and an MoE shared
expert's ``w13``), for readers of a checkpoint that have no model at hand."""


def whole_from_saved(name: str, t: torch.Tensor) -> torch.Tensor:
    """A parameter read whole from a checkpoint (``name``: tetrad's, with or without the
    ``model.`` prefix) as the single-process model stores it: a stacked weight ``[2f, h]``,
    gate rows then up rows, whether saved ``[2, f, h]`` or interleaved; anything else as it
    is."""
    if not name.endswith(STACKED_NAMES):
        return t
    if t.dim() == 2:
        t = stacked_from_interleaved(t)
    return t.flatten(0, 1)
