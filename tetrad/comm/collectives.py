"""Blocking collectives over one axis of a :class:`~tetrad.grid.Grid`.

Every collective of the runtime goes through these functions, so they are the one point where
communication can be counted and timed. On an axis of size 1 each is a no-op that moves no bytes.
All tensors are split or concatenated along dim 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.grid import Grid


def all_reduce(t: torch.Tensor, grid: Grid, axis: str, op: str = "sum") -> torch.Tensor:
    """Reduce ``t`` in place over ``axis`` (``op`` is ``"sum"`` or ``"max"``) and return it.

    Ring traffic per rank: ``2 (G-1)/G * t.numel() * t.element_size()`` bytes.
    """
    if grid.size(axis) > 1:
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        dist.all_reduce(t, op=red, group=grid.group(axis))
    return t


def all_gather(t: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
    """Concatenate every rank's ``t`` along dim 0 in axis order: ``[G*d0, ...]``.

    Ring traffic per rank: ``(G-1)/G`` of the output's bytes.
    """
    g = grid.size(axis)
    if g == 1:
        return t
    t = t.contiguous()
    out = torch.empty((g * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.all_gather_single(out, t, group=grid.group(axis))
    return out


def reduce_scatter(t: torch.Tensor, grid: Grid, axis: str) -> torch.Tensor:
    """Sum ``t`` over ``axis`` and keep this rank's dim-0 chunk: ``[d0/G, ...]``.

    Ring traffic per rank: ``(G-1)/G`` of the input's bytes (gloo emulates it with an
    all-reduce, about twice that).
    """
    g = grid.size(axis)
    if g == 1:
        return t
    t = t.contiguous()
    out = torch.empty((t.shape[0] // g, *t.shape[1:]), dtype=t.dtype, device=t.device)
    dist.reduce_scatter_single(out, t, group=grid.group(axis))
    return out
