"""Context parallelism: each sequence split over the ``G_context`` ranks of the context axis.

Causal attention costs more for late tokens than for early ones, so the sequence of ``S`` tokens
is cut into ``2 G_context`` chunks of ``c = S / (2 G_context)`` and context rank ``r`` holds
chunks ``r`` and ``2 G_context - 1 - r`` (the load-balanced order of Megatron-LM's context
parallelism and of Llama 3, Dubey et al., arXiv 2407.21783, section 3.3.2): every rank then
attends over ``(2 G_context + 1) c`` keys.

Attention all-gathers keys and values over the context axis (Llama 3's choice: with grouped-query
attention K and V are ``2 kv_heads / heads`` of the query's size, so one all-gather is cheaper
than a ring of point-to-point exchanges; the planner compares the two,
:mod:`tetrad.plan.comm.context_parallel`) and each local chunk attends over the keys up to its end
with a lower-right causal mask. Backward sums the key/value gradients with a reduce-scatter
over context. Everything else in a block is token-wise, so only RoPE needs the chunks' global
positions; gradients are summed over data x context (:class:`tetrad.spec.Axis`).

Shapes: this rank's tokens ``[b, s]`` with ``s = S / G_context``; q ``[b, heads/G_y, s, d]``,
k and v ``[b, kv_heads/G_y, s, d]``; the gathered K/V ``[b, kv_heads/G_y, S, d]``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tetrad.comm import all_gather, reduce_scatter
from tetrad.grid import Grid
from tetrad.spec import Axis


def chunk_ids(g: int, rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 g``) that context rank ``rank`` holds: ``(r, 2g-1-r)``."""
    return rank, 2 * g - 1 - rank


def split_sequence(t: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's tokens of ``t [b, S, ...]``: chunks ``r`` and ``2 G_context - 1 - r`` of
    ``2 G_context``, concatenated: ``[b, S/G_context, ...]``.

    Raises:
        ValueError: ``S`` not divisible by ``2 G_context``.
    """
    g = grid.context
    if g == 1:
        return t
    if t.shape[1] % (2 * g):
        raise ValueError(
            f"sequence length {t.shape[1]} is not divisible by 2*G_context = {2 * g}: "
            "choose a seq_len that is"
        )
    chunks = t.chunk(2 * g, dim=1)
    return torch.cat([chunks[i] for i in chunk_ids(g, grid.coord[Axis.CONTEXT])], dim=1)


def local_positions(s: int, grid: Grid, device: torch.device) -> torch.Tensor:
    """Global positions ``[s]`` (int64) of this rank's ``s = S / G_context`` tokens."""
    c = s // 2
    if grid.context == 1:
        return torch.arange(s, device=device)
    return torch.cat(
        [
            torch.arange(i * c, (i + 1) * c, device=device)
            for i in chunk_ids(grid.context, grid.coord[Axis.CONTEXT])
        ]
    )


class _GatherContext(torch.autograd.Function):
    """All-gather over context along dim 0 in forward; reduce-scatter of the gradient in
    backward (every rank's queries contributed to every rank's keys)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, grid: Grid) -> torch.Tensor:
        ctx.grid = grid
        return all_gather(t, grid, Axis.CONTEXT)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return reduce_scatter(g.contiguous(), ctx.grid, Axis.CONTEXT), None


_gather_context = torch.compiler.disable(_GatherContext.apply)


class ContextAttention:
    """Causal attention of this rank's two chunks over the whole sequence's keys and values.

    Called as ``attention(q, k, v)`` with the module docstring's shapes; returns
    ``[b, heads/G_y, s, d]``. The masks (additive, compute dtype, ``[c, (i+1) c]`` for chunk
    ``i``) and the chunk order are built once per shape and shared by every block.
    """

    def __init__(self, grid: Grid):
        self.grid = grid
        self._cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    def _constants(self, s: int, dtype: torch.dtype, device: torch.device):
        key = (s, dtype, device)
        if key not in self._cache:
            g, c = self.grid.context, s // 2
            order = [2 * j if j < g else 2 * (2 * g - 1 - j) + 1 for j in range(2 * g)]
            masks = []
            for i in chunk_ids(g, self.grid.coord[Axis.CONTEXT]):
                keys = (i + 1) * c
                allowed = torch.ones(c, keys, dtype=torch.bool, device=device).tril(keys - c)
                masks.append(
                    torch.zeros(c, keys, dtype=dtype, device=device).masked_fill(
                        ~allowed, float("-inf")
                    )
                )
            index = torch.tensor(order, device=device)
            self._cache[key] = (index, *masks)
        return self._cache[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, kvh, s, d = k.shape
        g, c = self.grid.context, s // 2
        index, *masks = self._constants(s, q.dtype, q.device)
        kv = torch.stack((k, v)).movedim(3, 0).contiguous()  # [s, 2, b, kvh, d]
        full = _gather_context(kv, self.grid)  # [G s, 2, b, kvh, d], rank order
        full = full.view(2 * g, c, 2, b, kvh, d).index_select(0, index).flatten(0, 1)
        keys, values = full[:, 0].permute(1, 2, 0, 3), full[:, 1].permute(1, 2, 0, 3)
        gqa = q.shape[1] != kvh
        outs = []
        with _masked_kernels(q.device):
            for half, mask in zip(q.split(c, dim=2), masks, strict=True):
                n = mask.shape[1]
                outs.append(
                    F.scaled_dot_product_attention(
                        half, keys[:, :, :n], values[:, :, :n], attn_mask=mask, enable_gqa=gqa
                    ).transpose(1, 2)
                )
        return torch.cat(outs, dim=1).transpose(1, 2)  # [b, heads, s, d], token-major


def _masked_kernels(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA the SDPA kernels that take an additive mask (memory-efficient attention, cuDNN);
    the training step otherwise allows only the flash kernels, which take none. Not yet run on
    a GPU. Elsewhere nothing: the CPU flash kernel takes the mask."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION])
