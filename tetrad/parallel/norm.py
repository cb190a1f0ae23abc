"""RMSNorm over a hidden dimension sharded over one grid axis.

``y = x / sqrt(mean_h(x^2) + eps) * w`` (Zhang and Sennrich 2019, arXiv 1910.07467, eq. 4) with
the sum of squares all-reduced over the sharding axis. That all-reduce's backward is again an
all-reduce: each rank's output shard contributes its own part of d(loss)/d(sum of squares).

The statistic (with the collective) and the element-wise apply are separate: under selective
activation checkpointing (:mod:`tetrad.models.recompute`) only the apply is recomputed in
backward, from the kept input and ``rstd``.

The statistics are fp32 whatever the input's format (the policy's ``statistics``), and no fp32
copy of a bf16 input is kept for backward: the sum of squares keeps the input itself
(:class:`_SquareSum`), and the apply of a bf16 input keeps only the input, ``rstd`` and the
weight, rebuilding the normalised tensor in backward (:class:`_NarrowApply`; Megatron-LM's
fused norms keep the same). An fp32 input's apply keeps its normalised tensor, as autograd
does.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.dtypes import compute_dtype
from tetrad.grid import Grid
from tetrad.models import recompute
from tetrad.parallel.placement import sharded_parameter
from tetrad.spec.grid import Axis


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``axis`` in forward and in backward (inputs and consumers are both sharded)."""

    @staticmethod
    def forward(ctx, t, grid: Grid, axis: Axis):
        ctx.grid, ctx.axis = grid, axis
        return all_reduce(t.clone(), grid, axis)

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.grid, ctx.axis), None, None


# The collective stays outside torch.compile's graphs (a graph break).
_all_reduce_sum = torch.compiler.disable(_AllReduceSum.apply)


class _SquareSum(torch.autograd.Function):
    """``x [..., n]`` -> ``sum(x^2) [..., 1]`` in fp32, saving ``x`` as it is (a bf16 input
    keeps no fp32 copy; ``x.float().pow(2)`` would save one). The gradient ``2 x g`` is the
    one ``pow`` gives, in ``x``'s dtype."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.float().pow(2).sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _mul(x, 2 * g, x.dtype)  # = (g (2 x)) rounded to x's dtype: doubling is exact


class RMSNorm(nn.Module):
    """RMSNorm of ``[..., dim/G_axis]`` activations; weight ``[dim/G_axis]``, replicated over
    the other axes (its gradient is summed over Z and data by ``sync_gradients``, and over
    ``sum_axes`` too: Y under sequence parallelism, where each Y rank normalises its own piece
    of the sequence, :mod:`tetrad.parallel.sequence`)."""

    def __init__(
        self,
        dim: int,
        grid: Grid,
        axis: Axis = Axis.X,
        eps: float = 1e-5,
        sum_axes: tuple[Axis, ...] = (),
    ):
        super().__init__()
        if dim % grid.size(axis):
            raise ValueError(f"RMSNorm dim {dim} is not divisible by G_{axis}={grid.size(axis)}")
        self.grid, self.axis, self.dim, self.eps = grid, axis, dim, eps
        self.weight = sharded_parameter((dim,), ((axis,),), grid, ("ones",), sum_axes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim/G_axis]`` -> the same shape in the compute dtype (the autocast dtype
        under autocast, so the next Linear's cast is a no-op and saves this very tensor)."""
        sum_sq = _all_reduce_sum(_SquareSum.apply(x), self.grid, self.axis)
        rstd = torch.rsqrt(sum_sq / self.dim + self.eps)  # [..., 1] fp32: kept in every mode
        apply = functools.partial(normalise, dtype=compute_dtype(x))
        return recompute.runner()(apply, x, rstd, self.weight)  # recomputed in selective mode


def normalise(x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, dtype: torch.dtype):
    """RMSNorm's element-wise part: ``((x rstd) w)`` cast to ``dtype`` (``x [..., n]``, ``rstd
    [..., 1]`` fp32, ``w [n]``); the product is taken in fp32 (at least: type promotion) and
    rounded to ``x``'s dtype before the weight, as the fused form did. A bf16 ``x``: through
    :class:`_NarrowApply` (nothing but ``x``, ``rstd`` and ``w`` kept for backward)."""
    if x.dtype == torch.bfloat16 and torch.is_grad_enabled():
        return _NarrowApply.apply(x, rstd, w, dtype)
    return _apply(x, rstd, w, dtype)


def _apply(x: torch.Tensor, rstd: torch.Tensor, w: torch.Tensor, dtype: torch.dtype):
    """``((x rstd) rounded to x's dtype) w``, cast to ``dtype``."""
    return _mul(_mul(x, rstd, x.dtype), w, dtype)


def _mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(a b).to(dtype)``, the product taken in the promoted dtype of ``a`` and ``b`` (fp32
    for a bf16 ``a`` and an fp32 ``b``) and rounded once. Outside torch.compile (which fuses
    the cast itself) and autograd, one ``torch.mul`` with ``out=`` in ``dtype``: on CUDA one
    kernel casts as it reads and writes (no fp32 temporary: 4 bytes per element of a bf16
    result instead of 12); the CPU's kernels cast through temporaries inside the op."""
    if torch.compiler.is_compiling() or (
        torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    ):
        return (a * b).to(dtype)
    out = torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=dtype, device=a.device)
    return torch.mul(a, b, out=out)


class _NarrowApply(torch.autograd.Function):
    """:func:`_apply` keeping ``x``, ``rstd`` and ``w`` for backward, which rebuilds the
    normalised ``(x rstd)`` rounded to ``x``'s dtype (autograd would keep it, ``2 n`` bytes per
    row of a bf16 ``x``). The gradients are autograd's for the same operations: ``dw = sum of g
    xn`` over the rows (in the product's dtype, then ``w``'s), ``dxn = g w`` rounded to ``x``'s
    dtype, ``dx = dxn rstd`` (fp32, rounded to ``x``'s), ``drstd = sum_n dxn x`` (fp32)."""

    @staticmethod
    def forward(ctx, x, rstd, w, dtype):
        ctx.save_for_backward(x, rstd, w)
        return _apply(x, rstd, w, dtype)

    @staticmethod
    def backward(ctx, g):
        x, rstd, w = ctx.saved_tensors
        xn = _mul(x, rstd, x.dtype)
        g = g.to(torch.promote_types(xn.dtype, w.dtype))
        dw = (g * xn).flatten(0, -2).sum(0).to(w.dtype)
        dxr = _mul(g, w, x.dtype)  # rounded to x's dtype, as autograd's cast back does
        dx = _mul(dxr, rstd, x.dtype)
        drstd = (dxr.to(rstd.dtype) * x).sum(-1, keepdim=True)
        return dx, drstd, dw, None
