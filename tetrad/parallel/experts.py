"""Grid side of the mixture-of-experts blocks (:mod:`tetrad.models.moe`): the routed experts
split over the expert-parallel axis (token dispatch and combine by all-to-all), and the step's
expert loads summed over the ranks that saw other tokens, for DeepSeek-V3's aux-loss-free bias
update.

Expert parallelism (``G_expert = P``) folds over the ranks of a pipeline stage, X first, then
Y, Z, context and data (:data:`tetrad.spec.grid.EXPERT_GRID_AXES`, Megatron-Core's MoE Parallel
Folding with expert tensor parallelism 1): each rank of an expert group holds ``E/P`` experts
and routes its own tokens (on Z, data and context ranks other sequences or positions; on Y and
X ranks its slice of the positions, :mod:`tetrad.parallel.moe_tensor`), so no expert is held
twice in a group, whichever axes it spans; per MoE block and micro-batch (torchtitan's
``AllToAllTokenDispatcher``, dropless):

    1. the ``T k`` slots sorted by expert (``counts [E]``), their token rows gathered;
    2. an all-to-all of the counts (``[P, E/P]``: what each rank sends to each other rank's
       experts), then one host read of the split sizes;
    3. an all-to-all of the rows (uneven splits), rows put expert-major, the local experts'
       grouped GEMMs, rows put back source-major;
    4. the all-to-all back, then the weighted combine on the token's own rank.

With the ``expert`` overlap (``pieces > 1``, :func:`tetrad.spec.overlap.expert_pieces`) the
rank's ``T`` tokens are cut into ``n`` pieces of consecutive tokens (Tutel's pipelining, Hwang
et al., arXiv 2206.03382): one all-to-all of every piece's counts and one host read, then every
piece's dispatch issued at once; piece ``i``'s experts compute while pieces ``i+1 ..`` are
still arriving, and its combine travels while piece ``i+1``'s experts compute. In backward the
pieces' gradient exchanges overlap the other pieces' expert GEMM backward the same way (the
launch and arrival are two autograd nodes, as the context overlap's pieces,
:mod:`tetrad.parallel.context`). Exposed: the first dispatch and the last combine, each ``1/n``
of the rows, in forward and in backward.

Backward runs the two row all-to-alls the other way (their autograd). Expert gradients are
summed over expert-data only, the stage's other ranks holding the same experts
(:attr:`tetrad.parallel.placement.Placement.grad_sum_axes`).
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn

from tetrad.comm import Handle, all_reduce, all_to_all
from tetrad.dtypes import compute_dtype
from tetrad.grid import Grid
from tetrad.models.moe import Router, combine, expert_swiglu, put_rows, sort_by_expert
from tetrad.parallel.placement import sharded_parameter
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import expert_pieces, piece_sizes


def expert_major(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows received source-major (``recv_counts [P, n]``: rows from source rank ``s`` for
    local expert ``e``, consecutive per source, expert-major within; ``total`` their sum, known
    on the host from the split sizes) -> ``(perm [total], counts [n])``: ``received[perm]``
    lists every local expert's rows together (expert ``e``'s from source 0, then 1, ...) and
    ``counts`` the rows per local expert. No host synchronisation: ``repeat_interleave`` is
    given its output size."""
    flat = recv_counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view_as(recv_counts)
    lengths = recv_counts.t().flatten()  # blocks in (expert, source) order
    block_start = starts.t().flatten()
    first = torch.cumsum(lengths, 0) - lengths
    expand = functools.partial(torch.repeat_interleave, repeats=lengths, output_size=total)
    within = torch.arange(total, device=flat.device) - expand(first)
    perm = expand(block_start) + within
    return perm, recv_counts.sum(0)


class _Exchange:
    """The in-flight row all-to-alls of one MoE block's pieces, keyed ``(kind, piece)``: those
    issued in forward (waited by :class:`_Arrive`) and the gradients' issued in backward (waited
    by :class:`_Send`)."""

    def __init__(self, grid: Grid):
        self.grid = grid
        self.forward: dict[tuple[str, int], Handle] = {}
        self.backward: dict[tuple[str, int], Handle] = {}


class _Send(torch.autograd.Function):
    """Forward: issue the all-to-all of ``t`` (rows ``input_splits`` to each rank of the expert
    group, ``output_splits`` back) and return an empty token for :class:`_Arrive`. Backward:
    wait for the gradient's all-to-all that :class:`_Arrive`'s backward issued."""

    @staticmethod
    def forward(ctx, t, state: _Exchange, key, output_splits, input_splits):
        ctx.state, ctx.key = state, key
        state.forward[key] = all_to_all(
            t, state.grid, Axis.EXPERT, output_splits, input_splits, async_op=True
        )
        return t.new_empty(0)

    @staticmethod
    def backward(ctx, _token):
        return ctx.state.backward.pop(ctx.key).wait(), None, None, None, None


class _Arrive(torch.autograd.Function):
    """Forward: wait for the all-to-all :class:`_Send` issued under ``key``. Backward: issue the
    all-to-all of the gradient, splits swapped (the rows go back the way they came), and go
    on."""

    @staticmethod
    def forward(ctx, token, state: _Exchange, key, output_splits, input_splits):
        ctx.state, ctx.key, ctx.splits = state, key, (output_splits, input_splits)
        return state.forward.pop(key).wait()

    @staticmethod
    def backward(ctx, g):
        outs, ins = ctx.splits
        ctx.state.backward[ctx.key] = all_to_all(
            g, ctx.state.grid, Axis.EXPERT, ins, outs, async_op=True
        )
        return g.new_zeros(0), None, None, None, None


class ExpertParallelExperts(nn.Module):
    """``E`` routed SwiGLU experts split over the expert axis of ``grid``: this rank holds
    experts ``[c E/P, (c+1) E/P)`` (``c = coord["expert"]``), the same interface as
    :class:`tetrad.models.moe.GroupedExperts`: ``(x [T, h], ids [T, k], weights [T, k] fp32)``
    -> ``[T, h]``, ``T`` this rank's tokens. Weights ``w1, w3 [E/P, F, h]``, ``w2 [E/P, h,
    F]``, each a shard of the global ``[E, ...]`` split on dim 0 over ``expert`` (checkpoint
    keys and initial values those of the reference, whatever ``P``). ``pieces``: the ``expert``
    overlap's most pieces (1: blocking all-to-alls; module docstring).

    Raises:
        ValueError: ``E`` not divisible by ``G_expert``.
    """

    def __init__(
        self,
        n_experts: int,
        dim: int,
        ffn_dim: int,
        out_std: float,
        grid: Grid,
        pieces: int = 1,
    ):
        super().__init__()
        if n_experts % grid.expert:
            raise ValueError(
                f"n_experts={n_experts} is not divisible by the expert parallelism "
                f"{grid.expert}: use an --expert-parallel that divides {n_experts}"
            )
        self.grid, self.n_experts, self.pieces = grid, n_experts, pieces
        split, f, h = ((Axis.EXPERT,),), ffn_dim, dim
        self.w1 = sharded_parameter((n_experts, f, h), split, grid, ("normal", 0.02))
        self.w3 = sharded_parameter((n_experts, f, h), split, grid, ("normal", 0.02))
        self.w2 = sharded_parameter((n_experts, h, f), split, grid, ("normal", out_std))

    @torch.compiler.disable  # all-to-alls with host-read split sizes: eager, like every collective
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, p, t = ids.shape[1], self.grid.expert, x.shape[0]
        n = expert_pieces(t, self.pieces)
        ends = list(itertools.accumulate(piece_sizes(t, n), initial=0))
        pieces = list(zip(ends[:-1], ends[1:], strict=True))
        sorts = [sort_by_expert(ids[a:b], self.n_experts) for a, b in pieces]
        counts = torch.stack([c for _, c in sorts]).view(n, p, -1)  # [n, P, E/P]
        # from each rank of the group, per piece, the rows for each of this rank's experts
        recv_counts = all_to_all(counts.transpose(0, 1).contiguous(), self.grid, Axis.EXPERT)
        # The one host synchronisation of the block, inherent to dropless dispatch: the row
        # all-to-alls need their split sizes on the host (torch's all_to_all_single takes
        # lists), and they depend on this step's routing on every rank of the group.
        splits = torch.cat([counts.sum(2).flatten(), recv_counts.sum(2).t().flatten()]).tolist()
        send = [splits[i * p : (i + 1) * p] for i in range(n)]
        recv = [splits[(n + i) * p : (n + i + 1) * p] for i in range(n)]
        dtype = compute_dtype(x)
        xc, state = x.to(dtype), _Exchange(self.grid)
        out = [  # every piece's dispatch issued at once
            _Send.apply(xc[a:b][order // k], state, ("dispatch", i), recv[i], send[i])
            for i, ((a, b), (order, _)) in enumerate(zip(pieces, sorts, strict=True))
        ]
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        for i in range(n):
            rows = _Arrive.apply(out[i], state, ("dispatch", i), recv[i], send[i])
            perm, local_counts = expert_major(recv_counts[:, i], sum(recv[i]))
            ys = expert_swiglu(rows[perm], local_counts, w1, w3, w2)
            ys = put_rows(ys, perm)  # back to source-major
            out[i] = _Send.apply(ys, state, ("combine", i), send[i], recv[i])
        for i, ((a, b), (order, _)) in enumerate(zip(pieces, sorts, strict=True)):
            home = _Arrive.apply(out[i], state, ("combine", i), send[i], recv[i])
            out[i] = combine(home, order, weights[a:b], dtype)
        return torch.cat(out) if n > 1 else out[0]

    def extra_repr(self) -> str:
        e, f, h = self.w1.shape
        return f"{e} of {self.n_experts} experts (G_expert={self.grid.expert}), {h}->{f}->{h}"


def biased_routers(model: nn.Module) -> list[Router]:
    """The routers of ``model`` that carry a selection bias (``bias_update_rate > 0``)."""
    return [m for m in model.modules() if isinstance(m, Router) and m.bias is not None]


@torch.no_grad()
def update_expert_biases(model: nn.Module, grid: Grid) -> None:
    """Update every router's selection bias from the token slots its experts received this
    step (:meth:`Router.update_bias`), the counts ``[E]`` of all routers summed in one buffer
    over Z, data x context, Y and X (every rank then holds the same biases; under expert
    parallelism and on tensor grids too, as each rank counts the slots its own tokens chose).
    Call once per optimizer step, after the last micro-batch; nothing to do for a model without
    biased routers.
    """
    routers = biased_routers(model)
    if not routers:
        return
    counts = torch.cat([r.tokens_per_expert for r in routers])
    all_reduce(counts, grid, Axis.Z)
    all_reduce(counts, grid, Axis.DATA)
    all_reduce(counts, grid, Axis.Y)  # tensor ranks route their own token slices
    all_reduce(counts, grid, Axis.X)
    for r, c in zip(routers, counts.split([r.n_experts for r in routers]), strict=True):
        r.update_bias(c)
