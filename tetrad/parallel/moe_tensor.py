"""The MoE feed-forward on 3D tensor-parallel grids (``G_y G_x > 1``): whole tokens for the
router and the experts, each tensor rank routing its own slice of them.

Between blocks the residual stream is ``[b, s, h/G_x]``, replicated over Y
(:mod:`tetrad.parallel.model`). The routed part of an MoE block needs whole tokens ``[., h]``;
rather than route every token on all ``n = G_y G_x`` tensor ranks (the same work ``n`` times),
the ``s`` positions of each sequence are cut into ``n`` contiguous slices and tensor rank
``t = y G_x + x`` takes slice ``t``:

    split   x [b, s, h/G_x] -> positions of Y block y [b, s/G_y, h/G_x]
            -> all-to-all_X (slice x' to X rank x') -> [b, s/n, h]
    (router, experts, expert-parallel all-to-alls over this rank's expert group, loss terms)
    join    y [b, s/n, h] -> all-to-all_X (feature block x' to X rank x') -> [b, s/G_y, h/G_x]
            -> all-gather_Y -> [b, s, h/G_x]

Each map's backward is the other one (activation gradients are whole on each replicated rank,
as everywhere on the grid: the gradient of slice ``t`` is the gathered output gradient's slice
``t``, and the input's gradient gathers every slice's). The router's and the experts' weights
are replicated over Y and X but see other tokens on each tensor rank, so their gradients are
summed over Y and X too (:attr:`tetrad.parallel.placement.Placement.sum_axes`); the
load-balancing statistics of a sequence are summed over context, Y and X (its parts), as under
context parallelism; the selection-bias counts over Y and X
(:func:`tetrad.parallel.experts.update_expert_biases`). With expert parallelism, the expert
groups are at fixed Y and X (:func:`tetrad.grid.expert_groups`), so each tensor rank's tokens
go to its own expert group.
"""

from __future__ import annotations

import torch

from tetrad.comm import all_gather, all_reduce, all_to_all
from tetrad.grid import Grid
from tetrad.spec.grid import Axis


def tensor_rank(grid: Grid) -> int:
    """This rank's index ``y G_x + x`` in its tensor group (its token slice)."""
    return grid.coord[Axis.Y] * grid.x + grid.coord[Axis.X]


def _split(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``[b, s, h/G_x]`` -> ``[b, s/n, h]``: this rank's Y block of positions (``s/G_y``, the
    slices of ranks ``(y, 0 .. G_x-1)``) exchanged over X, each rank keeping its slice with
    every X rank's features."""
    b, s, hx = x.shape
    n, y = grid.y * grid.x, grid.coord[Axis.Y]
    rows = x.movedim(1, 0)[y * s // grid.y : (y + 1) * s // grid.y]  # [s/G_y, b, h/G_x]
    got = all_to_all(rows, grid, Axis.X)  # [G_x s/n, b, h/G_x]: piece j = features of rank j
    got = got.reshape(grid.x, s // n, b, hx).permute(2, 1, 0, 3)  # [b, s/n, G_x, h/G_x]
    return got.reshape(b, s // n, grid.x * hx)


def _join(t: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``[b, s/n, h]`` -> ``[b, s, h/G_x]``: each feature block sent to its X rank (which then
    holds its Y block of positions), then all-gathered over Y."""
    b, sn, h = t.shape
    hx = h // grid.x
    pieces = t.reshape(b, sn, grid.x, hx).permute(2, 1, 0, 3)  # [G_x, s/n, b, h/G_x]
    rows = all_to_all(pieces.reshape(grid.x * sn, b, hx), grid, Axis.X)  # [s/G_y, b, h/G_x]
    return all_gather(rows, grid, Axis.Y).movedim(0, 1)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, grid: Grid):
        ctx.grid = grid
        return _split(x, grid)

    @staticmethod
    def backward(ctx, g):
        return _join(g, ctx.grid), None


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, grid: Grid):
        ctx.grid = grid
        return _join(y, grid)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.grid), None


# The collectives stay outside torch.compile's graphs (a graph break).
_split_apply = torch.compiler.disable(_Split.apply)
_join_apply = torch.compiler.disable(_Join.apply)


class TensorTokens:
    """The layer factory's ``moe_tokens`` on a grid with ``G_y G_x > 1`` (see the module
    docstring): :meth:`split` before the router, :meth:`join` after the experts,
    :meth:`total` for the load-balancing term's reported value."""

    def __init__(self, grid: Grid):
        self.grid, self.parts = grid, grid.y * grid.x

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """``x [b, s, h/G_x]`` (replicated over Y) -> this tensor rank's tokens ``[b, s/n, h]``
        (``n = G_y G_x``), differentiable.

        Raises:
            ValueError: ``s`` (this rank's positions per sequence) not divisible by ``n``.
        """
        if x.shape[1] % self.parts:
            raise ValueError(
                f"MoE on G_y*G_x={self.parts} tensor ranks needs the sequence positions per rank "
                f"({x.shape[1]}) divisible by {self.parts}: change --seq-len or the grid"
            )
        return _split_apply(x, self.grid)

    def join(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`split`: ``[b, s/n, h]`` -> ``[b, s, h/G_x]`` (replicated over
        Y), differentiable."""
        return _join_apply(y, self.grid)

    @torch.compiler.disable  # collectives stay outside compiled graphs
    def total(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux`` (0-dim, this tensor rank's share of a block's load-balancing term) with the
        value of the sum over the tensor group and the gradient of this rank's share only: the
        training step reports it as it does on other grids (summed over Z and data only), and
        each share is differentiated once."""
        whole = aux.detach().clone()
        all_reduce(whole, self.grid, Axis.Y)
        all_reduce(whole, self.grid, Axis.X)
        return aux + (whole - aux.detach())
