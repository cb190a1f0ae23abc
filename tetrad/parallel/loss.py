"""Vocabulary-parallel cross-entropy: the logits stay split, never gathered.

The vocabulary is split over one or more grid axes (the LM head's are Y and X, Y outer). With
logits ``z [T, V/G]`` on each rank (``G`` the product of the axes' sizes) and ``M = max_v z_v``
(all-reduce max over the axes), ``loss_t = log sum_v exp(z_v - M) - (z_target - M)``, both sums
all-reduced over the axes: three ``[T]`` fp32 all-reduces per axis, whatever ``V``. The gradient
on each rank is its own slice of ``softmax(z) - onehot(target)`` and needs no communication
(Shoeybi et al., Megatron-LM, arXiv 1909.08053, section 3: parallel output embedding + loss).
Memory: one fp32 ``[T, V/G]`` buffer beyond the logits, ``exp(z - M)``, kept for backward (the
division by the sum is folded into backward's scaling).
"""

from __future__ import annotations

import torch

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.spec import Axis


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, grid: Grid, axes: tuple[Axis, ...], vocab: int | None):
        vocab_local, block = logits.shape[-1], 0
        for a in axes:
            block = block * grid.size(a) + grid.coord[a]
        m = _all_reduce_over(logits.amax(dim=-1).float(), grid, axes, op="max")
        local = targets - block * vocab_local
        outside = (local < 0) | (local >= vocab_local)
        local = local.masked_fill(outside, 0)
        z_target = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).float() - m
        z_target = _all_reduce_over(z_target.masked_fill(outside, 0.0), grid, axes)
        # one fp32 [..., V/G] buffer, exp(z - M) in place; saved, and turned into the gradient
        # in place by backward
        exp = torch.empty_like(logits, dtype=torch.float32)
        torch.sub(logits, m.unsqueeze(-1), out=exp).exp_()
        if vocab is not None and vocab < (block + 1) * vocab_local:  # padding ids: no mass
            exp[..., max(0, vocab - block * vocab_local) :] = 0.0
        sum_exp = _all_reduce_over(exp.sum(dim=-1), grid, axes)
        ctx.save_for_backward(exp, sum_exp, local, outside)
        ctx.dtype = logits.dtype
        return sum_exp.log() - z_target

    @staticmethod
    def backward(ctx, dloss):
        # d loss_t / d z_v = softmax_v - [v = target]: one pass scales exp(z - M) by
        # dloss / sum_exp (the softmax's division folded in), then the target entries
        exp, sum_exp, local, outside = ctx.saved_tensors
        grad = exp.mul_((dloss / sum_exp).unsqueeze(-1))
        hit = dloss.masked_fill(outside, 0.0)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


def _all_reduce_over(t: torch.Tensor, grid: Grid, axes, op: str = "sum") -> torch.Tensor:
    for a in axes:
        t = all_reduce(t, grid, a, op=op)
    return t


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    grid: Grid,
    axes: Axis | tuple[Axis, ...] = (Axis.Y, Axis.X),
    vocab: int | None = None,
) -> torch.Tensor:
    """Per-token cross-entropy (nats) from vocabulary-sharded logits.

    Args:
        logits: ``[..., V/G]``, this rank's contiguous vocabulary block, block index
            ``sum_i coord(axes[i]) * prod_{j>i} G_{axes[j]}`` (the first axis outer), ``G``
            the product of the axes' sizes (any float dtype; computed in fp32).
        targets: ``[...]`` global token ids.
        axes: the axes splitting the vocabulary, outer first (one axis alone is allowed).
        vocab: the real vocabulary when the logits' is padded: ids ``>= vocab`` get no
            probability (their ``exp`` is zeroed, so their gradient is 0 too).
    Returns:
        ``[...]`` fp32 losses, identical on every rank of ``axes``.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return _VocabParallelCrossEntropy.apply(logits, targets, grid, axes, vocab)
