"""Vocabulary-parallel cross-entropy: the logits stay split, never gathered.

The vocabulary is split over one or more grid axes (the LM head's are Y and X, Y outer). With
logits ``z [T, V/G]`` on each rank (``G`` the product of the axes' sizes) and ``M = max_v z_v``
(all-reduce max over the axes), ``loss_t = log sum_v exp(z_v - M) - (z_target - M)``, both sums
all-reduced over the axes: three ``[T]`` fp32 all-reduces per axis, whatever ``V``. The gradient
on each rank is its own slice of ``softmax(z) - onehot(target)`` and needs no communication
(Shoeybi et al., Megatron-LM, arXiv 1909.08053, section 3: parallel output embedding + loss).
"""

from __future__ import annotations

import torch

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.spec import Axis


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, grid: Grid, axes: tuple[Axis, ...]):
        z = logits.float()
        vocab_local, block = z.shape[-1], 0
        for a in axes:
            block = block * grid.size(a) + grid.coord[a]
        m = _all_reduce_over(z.max(dim=-1).values, grid, axes, op="max")
        z = z - m.unsqueeze(-1)
        exp = z.exp()
        sum_exp = _all_reduce_over(exp.sum(dim=-1), grid, axes)
        local = targets - block * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        z_target = _all_reduce_over(z_target, grid, axes)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.dtype = logits.dtype
        return sum_exp.log() - z_target

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_(dloss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None


def _all_reduce_over(t: torch.Tensor, grid: Grid, axes, op: str = "sum") -> torch.Tensor:
    for a in axes:
        t = all_reduce(t, grid, a, op=op)
    return t


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid,
    axes: Axis | tuple[Axis, ...] = (Axis.Y, Axis.X),
) -> torch.Tensor:
    """Per-token cross-entropy (nats) from vocabulary-sharded logits.

    Args:
        logits: ``[..., V/G]``, this rank's contiguous vocabulary block, block index
            ``sum_i coord(axes[i]) * prod_{j>i} G_{axes[j]}`` (the first axis outer), ``G``
            the product of the axes' sizes (any float dtype; computed in fp32).
        targets: ``[...]`` global token ids.
        axes: the axes splitting the vocabulary, outer first (one axis alone is allowed).
    Returns:
        ``[...]`` fp32 losses, identical on every rank of ``axes``.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return _VocabParallelCrossEntropy.apply(logits, targets, grid, axes)
