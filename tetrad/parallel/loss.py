"""Vocabulary-parallel cross-entropy: the logits stay split over Y, never gathered.

With logits ``z [T, V/G_y]`` on each Y rank and ``M = max_v z_v`` (all-reduce max over Y),
``loss_t = log sum_v exp(z_v - M) - (z_target - M)``, both sums all-reduced over Y. The gradient
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
    def forward(ctx, logits, targets, grid: Grid, axis: Axis):
        z = logits.float()
        vocab_local = z.shape[-1]
        m = all_reduce(z.max(dim=-1).values, grid, axis, op="max")
        z = z - m.unsqueeze(-1)
        exp = z.exp()
        sum_exp = all_reduce(exp.sum(dim=-1), grid, axis)
        local = targets - grid.coord[axis] * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        z_target = all_reduce(z_target, grid, axis)
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


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, grid: Grid, axis: Axis = Axis.Y
) -> torch.Tensor:
    """Per-token cross-entropy (nats) from vocabulary-sharded logits.

    Args:
        logits: ``[..., V/G_axis]``, this rank's contiguous vocabulary block (any float dtype;
            computed in fp32).
        targets: ``[...]`` global token ids.
    Returns:
        ``[...]`` fp32 losses, identical on every rank of ``axis``.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, grid, axis)
