"""3D tensor-parallel token embedding.

The table ``E [V, h]`` is laid out like a transposed Linear whose input is the one-hot token:
vocabulary rows over Y (each block's rows again over Z), hidden columns over X. Stored shard:
``[V/(G_y G_z), h/G_x]``.

    forward:   E = all-gather_Z(E_shard);  out = all-reduce_Y(lookup of ids in this Y block)
    backward:  dE_shard = reduce-scatter_Z(scatter-add of d_out into this Y block's rows)
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import all_gather, all_reduce, reduce_scatter
from tetrad.grid import Grid
from tetrad.parallel.placement import sharded_parameter


class _Embedding3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, e_shard, grid: Grid):
        e = all_gather(e_shard.detach(), grid, "z")  # [V/G_y, h/G_x]
        local = ids - grid.coord["y"] * e.shape[0]
        outside = (local < 0) | (local >= e.shape[0])
        local = local.masked_fill(outside, 0)
        out = e[local].masked_fill(outside.unsqueeze(-1), 0.0)
        all_reduce(out, grid, "y")
        ctx.save_for_backward(local, outside, e_shard)
        ctx.grid, ctx.rows = grid, e.shape[0]
        return out

    @staticmethod
    def backward(ctx, dout):
        local, outside, e_shard = ctx.saved_tensors
        dout = dout.masked_fill(outside.unsqueeze(-1), 0.0).to(e_shard.dtype)
        de = torch.zeros(ctx.rows, dout.shape[-1], dtype=e_shard.dtype, device=dout.device)
        de.index_add_(0, local.reshape(-1), dout.reshape(-1, dout.shape[-1]))
        return None, reduce_scatter(de, ctx.grid, "z"), None


class Embedding(nn.Module):
    """Token ids ``[B/(G_data G_z), S]`` -> hidden states ``[B/(G_data G_z), S, h/G_x]``,
    replicated over Y. Weight stored as ``[V/(G_y G_z), h/G_x]``.

    Raises:
        ValueError: ``V`` not divisible by ``G_y*G_z`` or ``h`` by ``G_x``.
    """

    def __init__(self, num_embeddings: int, dim: int, grid: Grid, init_std: float = 0.02):
        super().__init__()
        if num_embeddings % (grid.y * grid.z) or dim % grid.x:
            raise ValueError(f"Embedding {num_embeddings}x{dim} does not divide over grid {grid}")
        self.grid, self.num_embeddings, self.dim = grid, num_embeddings, dim
        self.weight = sharded_parameter((num_embeddings, dim), (("y", "z"), ("x",)), grid,
                                        ("normal", init_std))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Embedding3D.apply(ids, self.weight, self.grid)
