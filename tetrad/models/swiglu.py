"""SwiGLU's gate (Shazeer, arXiv 2002.05202, eq. 6) on the fused projection's interleaved output.

The gate and up projections are one Linear whose output features interleave them (``gate_0,
up_0, gate_1, up_1, ...``: :class:`tetrad.models.llama.FeedForward`). Taken apart by indexing,
autograd's backward gives each half a zero-filled tensor of the whole ``[..., 2f]`` input with its
gradient copied into every other element, then adds the two: two fills, two copies and a sum
where one write would do. Eagerly, :class:`_SwiGLU` writes both halves' gradients into one new
tensor instead, and keeps only its input for backward (``silu(gate)`` is rebuilt there: a
quarter of the MLP's saved activations); under ``torch.compile`` the plain expression is traced
and Inductor fuses it (its partitioner recomputes ``silu(gate)`` as well).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of interleaved ``[..., 2f]`` features -> ``[..., f]``, in
    ``gate_up``'s dtype. The gradient is autograd's for the same expression."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and gate_up.requires_grad):
        gate, up = _halves(gate_up)
        return F.silu(gate) * up
    return _SwiGLU.apply(gate_up)


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up features of ``[..., 2f]``: two ``[..., f]`` views (stride 2)."""
    pairs = gate_up.unflatten(-1, (-1, 2))
    return pairs[..., 0], pairs[..., 1]


class _SwiGLU(torch.autograd.Function):
    """:func:`swiglu` keeping only its input ``[..., 2f]`` (autograd would keep ``silu(gate)
    [..., f]`` too; Megatron-LM's fused SwiGLU keeps the input alone as well); backward rebuilds
    ``silu(gate)``, computes autograd's gradients (``d up = g silu(gate)``, ``d gate =
    silu'(gate) g up``, with ``aten.silu_backward``) and writes them straight into the
    interleaved ``[..., 2f]`` gradient."""

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = _halves(gate_up)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g):
        (gate_up,) = ctx.saved_tensors
        gate, up = _halves(gate_up)
        silu = F.silu(gate)  # rebuilt: an element-wise pass instead of [..., f] kept per block
        grad = torch.empty_like(gate_up, memory_format=torch.contiguous_format)
        d_gate, d_up = _halves(grad)
        torch.mul(g, silu, out=d_up)
        torch.ops.aten.silu_backward.grad_input(g * up, gate, grad_input=d_gate)
        return grad
