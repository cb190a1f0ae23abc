"""The LM head with its vocabulary split over both tensor axes: logits are never all-reduced.

A plain 3D Linear ``h -> V`` (input over X, output over Y) would all-reduce its output, the
logits ``[m, V/G_y]``, over X: with a real vocabulary (128K) that is ``V / h`` = 32 times a
hidden-state all-reduce. Instead the head gathers its *input* over X (``[m, h]``, cheap) and
splits the vocabulary over Y and X (and, for storage, Z); each rank's logits are its own
vocabulary block, and the cross-entropy (:mod:`tetrad.parallel.loss`) reduces only per-token
statistics over Y and X (Megatron-LM's parallel output layer, Shoeybi et al., arXiv 1909.08053,
section 3, extended to two axes). Weight ``W [V, h]``: rows in ``G_y G_x`` blocks (Y outer),
each block's rows again over Z; columns whole. Stored shard ``[V/(G_y G_x G_z), h]``.

    forward:   W = all-gather_Z(W_shard)                  [V/(G_y G_x), h]
               x = all-gather_X(x_local)                   [m, h/G_x] -> [m, h]
               logits = x W^T                              [m, V/(G_y G_x)], block y G_x + x
    backward:  dx = all-reduce_Y(reduce-scatter_X(dlogits W))       [m, h/G_x]
               dW_shard = reduce-scatter_Z(dlogits^T x)

The head is the last layer of forward and the first of backward, with only the loss between,
so its gathered ``W`` is kept from forward to backward rather than all-gathered again (as
FSDP2 keeps its root module unsharded after forward): one Z all-gather per micro-batch, not two.

With sequence parallelism (:mod:`tetrad.parallel.sequence`) the input is
``[b, s/G_y, h/G_x]``, all-gathered along the sequence over Y first, and ``dx``
reduce-scattered along the sequence over Y instead of all-reduced.

Per micro-batch its X/Y collectives move ``m h`` elements (all-gather and reduce-scatter over
X, payload ``m h``) and ``m h / G_x`` (all-reduce over Y), whatever ``V``.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import all_gather, reduce_scatter
from tetrad.dtypes import compute_dtype
from tetrad.grid import Grid
from tetrad.parallel.linear import reduce_weight_gradient
from tetrad.parallel.overlap import Overlap
from tetrad.parallel.placement import sharded_parameter
from tetrad.parallel.sequence import gather_sequence
from tetrad.spec.grid import Axis


def gather_hidden(x: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``[..., h/G_x]`` -> ``[..., h]``: the all-gather over X of the hidden dimension."""
    g, lead, hx = grid.x, x.shape[:-1], x.shape[-1]
    rows = all_gather(x.reshape(-1, hx), grid, Axis.X)  # [G_x m, h/G_x], X rank major
    return rows.view(g, -1, hx).permute(1, 0, 2).reshape(*lead, g * hx)


def scatter_hidden(dx: torch.Tensor, grid: Grid) -> torch.Tensor:
    """``[..., h]`` -> ``[..., h/G_x]``: sum over X and keep this X rank's hidden slice (a
    reduce-scatter over X)."""
    g, lead, h = grid.x, dx.shape[:-1], dx.shape[-1]
    rows = dx.reshape(-1, g, h // g).transpose(0, 1).reshape(-1, h // g)
    return reduce_scatter(rows, grid, Axis.X).view(*lead, h // g)


def gather_input(x: torch.Tensor, grid: Grid, sequence: bool) -> torch.Tensor:
    """The head's input whole on every rank of its group: ``[b, s, h/G_x]`` -> ``[b, s, h]``
    (:func:`gather_hidden`), with ``sequence`` from ``[b, s/G_y, h/G_x]``, first gathered along
    the sequence over Y (:func:`tetrad.parallel.sequence.gather_sequence`)."""
    return gather_hidden(gather_sequence(x, grid) if sequence else x, grid)


def scatter_input(dx: torch.Tensor, ov: Overlap, sequence: bool):
    """Start the sum of the input gradient ``dx [b, s, h]`` back to the input's layout
    (:func:`gather_input`): reduce-scatter over X, then all-reduce over Y, or with ``sequence``
    reduce-scatter over Y along the sequence; a :class:`tetrad.comm.Handle`, in flight with
    the ``dx_all_reduce`` overlap."""
    dx = scatter_hidden(dx, ov.grid)
    return ov.backward_scatter_sequence(dx) if sequence else ov.backward_all_reduce(dx, Axis.Y)


class _VocabParallelHead(torch.autograd.Function):
    """``logits = all-gather_X(x) @ all-gather_Z(W_shard)^T``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, w_shard, ov: Overlap, sequence: bool):
        dtype = compute_dtype(x)
        w = ov.gather_weight(w_shard, dtype)
        x_full = gather_input(x.to(dtype), ov.grid, sequence)
        ctx.save_for_backward(x_full)
        ctx.weight, ctx.ov, ctx.sequence = w_shard, ov, sequence  # the Parameter itself
        ctx.w = w  # kept for backward: no second all-gather (module docstring)
        return x_full @ w.t()

    @staticmethod
    def backward(ctx, dlogits):
        (x_full,) = ctx.saved_tensors
        w_shard, ov, w = ctx.weight, ctx.ov, ctx.w
        ctx.w = None  # ctx attributes outlive backward with the graph: release the weight now
        dlogits = dlogits.to(w.dtype)
        dx = scatter_input(dlogits @ w, ov, ctx.sequence)  # during dW
        reduce_weight_gradient(ov, w_shard, dlogits, x_full)
        return dx.wait(), None, None, None


class VocabParallelHead(nn.Module):
    """Hidden states ``[..., dim/G_x]`` (replicated over Y) -> logits ``[..., V/(G_y G_x)]``,
    this rank's vocabulary block ``y G_x + x``. Weight stored as ``[V/(G_y G_x G_z), dim]``.
    With ``sequence_parallel`` the input is ``[b, s/G_y, dim/G_x]``, this Y rank's piece of
    the sequence, and the logits ``[b, s, V/(G_y G_x)]``.

    Raises:
        ValueError: ``V`` not divisible by ``G_y G_x G_z`` or ``dim`` by ``G_x``.
    """

    def __init__(
        self,
        dim: int,
        vocab: int,
        grid: Grid,
        init_std: float = 0.02,
        overlap: Overlap | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel and grid.y > 1
        if vocab % (grid.y * grid.x * grid.z) or dim % grid.x:
            raise ValueError(
                f"LM head {dim}->{vocab} needs vocab % (G_y*G_x*G_z) == 0 and dim % G_x == 0 "
                f"on grid {grid}"
            )
        self.overlap = overlap if overlap is not None else Overlap(grid, enabled=())
        self.grid, self.dim, self.vocab = grid, dim, vocab
        self.weight = sharded_parameter(
            (vocab, dim), ((Axis.Y, Axis.X, Axis.Z), ()), grid, ("normal", init_std)
        )

    @torch.compiler.disable  # collectives and the overlap state stay outside compiled graphs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _VocabParallelHead.apply(x, self.weight, self.overlap, self.sequence_parallel)

    def extra_repr(self) -> str:
        return f"{self.dim}->{self.vocab}, vocabulary over Y and X, input gathered over X"
