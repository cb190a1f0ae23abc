"""3D tensor-parallel token embedding.

The table ``E [V, h]`` is laid out like a transposed Linear whose input is the one-hot token:
vocabulary rows over Y (each block's rows again over Z), hidden columns over X. Stored shard:
``[V/(G_y G_z), h/G_x]``.

    forward:   E = all-gather_Z(E_shard) (compute dtype);  out = all-reduce_Y(lookup of ids in
               this Y block), in the residual stream's dtype (the policy's: bf16 or fp32)
    backward:  dE_shard = reduce-scatter_Z(scatter-add of d_out into this Y block's rows)

With sequence parallelism (:mod:`tetrad.parallel.sequence`) the all-reduce over Y is a
reduce-scatter along the sequence (out ``[b, s/G_y, h]``), and backward first all-gathers
``d_out`` along the sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.dtypes import compute_dtype, residual_dtype
from tetrad.grid import Grid
from tetrad.parallel.masters import grad_dtype
from tetrad.parallel.overlap import Overlap
from tetrad.parallel.placement import sharded_parameter
from tetrad.parallel.sequence import gather_sequence, scatter_sequence
from tetrad.spec.grid import Axis


class _Embedding3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, e_shard, ov: Overlap, sequence: bool):
        grid, dtype = ov.grid, compute_dtype(e_shard)
        # [V/G_y, h/G_x]: over Z gathered in the compute dtype, as every Linear weight is
        e = ov.gather_weight(e_shard, dtype) if grid.z > 1 else e_shard
        local = ids - grid.coord[Axis.Y] * e.shape[0]
        outside = (local < 0) | (local >= e.shape[0])
        if grid.y > 1:  # one block holds all V ids with G_y = 1: nothing to mask
            local = local.masked_fill(outside, 0)
        # rows in the compute dtype on every grid (the same values whatever G_z), then in the
        # residual stream's dtype
        out = e[local].to(dtype).to(residual_dtype(e_shard.device, e_shard.dtype))
        if grid.y > 1:  # rows of other Y blocks' ids are zero here; the sum over Y fills them
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
            out = scatter_sequence(out, grid) if sequence else all_reduce(out, grid, Axis.Y)
        ctx.save_for_backward(local, outside)
        ctx.weight, ctx.ov, ctx.rows = e_shard, ov, e.shape[0]  # the Parameter itself
        ctx.sequence = sequence
        return out

    @staticmethod
    def backward(ctx, dout):
        local, outside = ctx.saved_tensors
        e_shard = ctx.weight
        if ctx.sequence:  # [b, s/G_y, h] -> [b, s, h]
            dout = gather_sequence(dout, ctx.ov.grid)
        if ctx.ov.grid.y > 1:  # rows of ids in other Y blocks add nothing here
            dout = dout.masked_fill(outside.unsqueeze(-1), 0.0)
        dout = dout.to(grad_dtype(e_shard))
        ids, rows = local.reshape(-1), dout.reshape(-1, dout.shape[-1])
        have = ctx.ov.grad_to_add_into(e_shard)  # a later micro-batch: no zeroed table, no add
        if have is not None:
            have.index_add_(0, ids, rows)
            ctx.ov.weight_grad_added(e_shard)
            return None, None, None, None
        de = ctx.ov.grad_slot(e_shard)  # its place in the data-parallel bucket, if offered
        if de is None:
            de = torch.zeros(ctx.rows, dout.shape[-1], dtype=dout.dtype, device=dout.device)
        else:
            de.zero_()
        de.index_add_(0, ids, rows)
        ctx.ov.reduce_weight_grad(e_shard, de)
        return None, None, None, None


class Embedding(nn.Module):
    """Token ids ``[B/(G_data G_z), S]`` -> hidden states ``[B/(G_data G_z), S, h/G_x]``,
    replicated over Y; with ``sequence_parallel`` ``[B/(G_data G_z), S/G_y, h/G_x]``, this Y
    rank's piece of the sequence. Weight stored as ``[V/(G_y G_z), h/G_x]``.

    Raises:
        ValueError: ``V`` not divisible by ``G_y*G_z`` or ``h`` by ``G_x``.
    """

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        grid: Grid,
        init_std: float = 0.02,
        overlap: Overlap | None = None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.sequence_parallel = sequence_parallel and grid.y > 1
        self.overlap = overlap if overlap is not None else Overlap(grid, enabled=())
        if num_embeddings % (grid.y * grid.z) or dim % grid.x:
            raise ValueError(f"Embedding {num_embeddings}x{dim} does not divide over grid {grid}")
        self.grid, self.num_embeddings, self.dim = grid, num_embeddings, dim
        self.weight = sharded_parameter(
            (num_embeddings, dim), ((Axis.Y, Axis.Z), (Axis.X,)), grid, ("normal", init_std)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Embedding3D.apply(ids, self.weight, self.overlap, self.sequence_parallel)
