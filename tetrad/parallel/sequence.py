"""Sequence parallelism over the Y role (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", arXiv 2205.05198, section 4.2.2).

The residual stream ``[b, S, h/G_x]`` between tetrad's layer pairs, the norms and the residual
adds are the same on every Y rank (with ``G_x = 1`` the pairs are Megatron-LM's column-then-row
tensor parallelism over Y). Under sequence parallelism each Y rank keeps ``S / G_y``
contiguous tokens of every sample of that stream instead: ``[b, S/G_y, h/G_x]``, Y rank ``y``
holding positions ``y S/G_y ... (y + 1) S/G_y - 1`` of this rank's ``S`` (with context
parallelism, of its two chunks laid end to end); with ``G_x > 1`` the stream is then split over
both tensor axes, as the issue asked of the 3D layout. The all-reduce over Y of each pair
becomes two collectives of the same ring bytes (the all-reduces over X stay):

    first layer of a pair (wqkv, w13), and the LM head:
        forward   x = all-gather_Y(x_shard) along the sequence        [b, S, k/G_x]
        backward  dx_shard = reduce-scatter_Y(dy W) along the sequence [b, S/G_y, k/G_x]
    second layer (wo, w2), and the token embedding:
        forward   y_shard = reduce-scatter_Y(x W^T) along the sequence
        backward  dy = all-gather_Y(dy_shard) along the sequence

(an all-reduce sends ``2 (G-1)/G`` of its payload per rank, an all-gather and a reduce-scatter
``(G-1)/G`` each). Norm weights then see a slice of the tokens on each Y rank, so their
gradients are summed over Y too. The gathered input of a first layer is kept for its weight
gradient, as without sequence parallelism: no collective is added in backward. With
``regather`` (Korthikanti et al.'s choice, and Megatron-LM's) it keeps its shard
``[b, S/G_y, k/G_x]`` instead and all-gathers it again in backward, issued before the input
gradient's GEMM and waited before the weight gradient's: one more all-gather over Y per first
layer and micro-batch, ``G_y`` times less saved.

On a rank's tensors ``[b, s, ...]`` with ``b > 1`` the Y ranks' pieces interleave in memory,
so the gather and the reduce-scatter copy once to put them in order; with ``b = 1`` both are
views.
"""

from __future__ import annotations

import torch

from tetrad.comm import Handle, all_gather, reduce_scatter
from tetrad.grid import Grid
from tetrad.spec.grid import Axis


def gather_sequence(x: torch.Tensor, grid: Grid, async_op: bool = False) -> torch.Tensor | Handle:
    """``[b, s/G_y, ...]`` -> ``[b, s, ...]``: the all-gather over Y along the sequence (dim 1),
    Y rank ``y``'s piece at ``y s/G_y``; a :class:`Handle` to it with ``async_op`` (the pieces
    are put in order by its ``wait``)."""
    g = grid.y
    if g == 1:
        return Handle(None, x, None, 0.0) if async_op else x
    b, piece, tail = x.shape[0], x.shape[1], x.shape[2:]

    def in_order(out: torch.Tensor) -> torch.Tensor:  # [G_y b, s/G_y, ...], Y rank major
        return out.view(g, b, piece, *tail).transpose(0, 1).reshape(b, g * piece, *tail)

    h = all_gather(x.contiguous(), grid, Axis.Y, async_op=True)
    h.post = in_order
    return h if async_op else h.wait()


def scatter_sequence(x: torch.Tensor, grid: Grid, async_op: bool = False) -> torch.Tensor | Handle:
    """``[b, s, ...]`` -> ``[b, s/G_y, ...]``: the sum over Y, of which this Y rank keeps its
    piece of the sequence (a reduce-scatter over Y along dim 1); a :class:`Handle` to it with
    ``async_op``.

    Raises:
        ValueError: ``s`` not divisible by ``G_y``.
    """
    g = grid.y
    if g == 1:
        return Handle(None, x, None, 0.0) if async_op else x
    b, s, tail = x.shape[0], x.shape[1], x.shape[2:]
    if s % g:
        raise ValueError(f"sequence parallelism: {s} tokens do not split over G_y={g}")
    ordered = x.reshape(b, g, s // g, *tail).transpose(0, 1).reshape(g * b, s // g, *tail)
    return reduce_scatter(ordered, grid, Axis.Y, async_op=async_op)
