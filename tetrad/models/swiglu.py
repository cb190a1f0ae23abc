"""SwiGLU's gate (Shazeer, arXiv 2002.05202, eq. 6) on the fused projection's output.

The gate and up projections are one Linear whose weight stacks them (:class:`tetrad.models.
llama.FeedForward`), so its output features are ``[gate, up]``; a weight split over Z gives
``pieces`` such pairs one after the other (``[gate_0, up_0, gate_1, up_1, ...]``, each block
``f / pieces`` features; :class:`tetrad.parallel.linear.Linear`). Gate and up are then runs of
contiguous features, which element-wise kernels read at full speed (interleaved single
features, the layout before, made SiLU and its backward 4x slower on the CPU, where a strided
operand leaves the vectorised loop).

Eagerly, :class:`_SwiGLU` keeps only its input for backward (``silu(gate)`` is rebuilt there:
a quarter of the MLP's saved activations) and writes both halves' gradients into one new
tensor; taken apart by indexing, autograd's backward would give each half a zero-filled tensor
of the whole ``[..., 2f]`` input and add the two. Under ``torch.compile`` the plain expression
is traced and Inductor fuses it (its partitioner recomputes ``silu(gate)`` as well).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor, pieces: int = 1) -> torch.Tensor:
    """``silu(gate) * up`` of ``[..., 2f]`` features in ``pieces`` ``[gate, up]`` pairs (module
    doc) -> ``[..., f]``, in ``gate_up``'s dtype, feature ``i`` of the output from gate and up
    feature ``i``. The gradient is autograd's for the same expression."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and gate_up.requires_grad):
        gate, up = _halves(gate_up, pieces)
        return (F.silu(gate) * up).flatten(-2)
    return _SwiGLU.apply(gate_up, pieces)


def _halves(gate_up: torch.Tensor, pieces: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up features of ``[..., 2f]``: two ``[..., pieces, f/pieces]`` views."""
    pairs = gate_up.unflatten(-1, (pieces, 2, -1))
    return pairs[..., 0, :], pairs[..., 1, :]


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu` keeping only its input ``[..., 2f]`` (autograd would keep ``silu(gate)
    [..., f]`` too; Megatron-LM's fused SwiGLU keeps the input alone as well); backward rebuilds
    ``silu(gate)``, computes autograd's gradients (``d up = g silu(gate)``, ``d gate =
    silu'(gate) g up``, with ``aten.silu_backward``) and writes them straight into the
    ``[..., 2f]`` gradient."""

    @staticmethod
    def forward(ctx, gate_up, pieces):
        gate, up = _halves(gate_up, pieces)
        ctx.save_for_backward(gate_up)
        ctx.pieces = pieces
        return F.silu(gate).mul_(up).flatten(-2)  # the product in silu's buffer

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors
        gate, up = _halves(gate_up, ctx.pieces)
        g = g.unflatten(-1, (ctx.pieces, -1))
        grad = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        d_gate, d_up = _halves(grad, ctx.pieces)
        # d_up's half holds g * up first (no temporary), then silu(gate), rebuilt: an
        # element-wise pass instead of [..., f] kept per block, then g times it
        torch.mul(g, up, out=d_up)
        torch.ops.aten.silu_backward.grad_input(d_up, gate, grad_input=d_gate)
        torch.ops.aten.silu.out(gate, out=d_up).mul_(g)
        return grad, None
