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

Backward runs the two row all-to-alls the other way (their autograd). Expert gradients are
summed over expert-data only, the stage's other ranks holding the same experts
(:attr:`tetrad.parallel.placement.Placement.grad_sum_axes`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tetrad.comm import all_reduce, all_to_all, all_to_all_autograd
from tetrad.dtypes import compute_dtype
from tetrad.grid import Grid
from tetrad.models.moe import Router, combine, expert_swiglu, sort_by_expert
from tetrad.parallel.placement import sharded_parameter
from tetrad.spec.grid import Axis


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


class ExpertParallelExperts(nn.Module):
    """``E`` routed SwiGLU experts split over the expert axis of ``grid``: this rank holds
    experts ``[c E/P, (c+1) E/P)`` (``c = coord["expert"]``), the same interface as
    :class:`tetrad.models.moe.GroupedExperts`: ``(x [T, h], ids [T, k], weights [T, k] fp32)``
    -> ``[T, h]``, ``T`` this rank's tokens. Weights ``w1, w3 [E/P, F, h]``, ``w2 [E/P, h,
    F]``, each a shard of the global ``[E, ...]`` split on dim 0 over ``expert`` (checkpoint
    keys and initial values those of the reference, whatever ``P``).

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
    ):
        super().__init__()
        if n_experts % grid.expert:
            raise ValueError(
                f"n_experts={n_experts} is not divisible by the expert parallelism "
                f"{grid.expert}: use an --expert-parallel that divides {n_experts}"
            )
        self.grid, self.n_experts = grid, n_experts
        split, f, h = ((Axis.EXPERT,),), ffn_dim, dim
        self.w1 = sharded_parameter((n_experts, f, h), split, grid, ("normal", 0.02))
        self.w3 = sharded_parameter((n_experts, f, h), split, grid, ("normal", 0.02))
        self.w2 = sharded_parameter((n_experts, h, f), split, grid, ("normal", out_std))

    @torch.compiler.disable  # all-to-alls with host-read split sizes: eager, like every collective
    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k, p = ids.shape[1], self.grid.expert
        order, counts = sort_by_expert(ids, self.n_experts)
        dtype = compute_dtype(x)
        xs = x.to(dtype)[order // k]
        recv_counts = all_to_all(counts, self.grid, Axis.EXPERT).view(p, -1)
        send = counts.view(p, -1).sum(1)
        # The one host synchronisation of the block, inherent to dropless dispatch: the row
        # all-to-alls need their split sizes on the host (torch's all_to_all_single takes
        # lists), and they depend on this step's routing on every rank of the group.
        splits = torch.cat([send, recv_counts.sum(1)]).tolist()
        send_splits, recv_splits = splits[:p], splits[p:]
        rows = all_to_all_autograd(xs, self.grid, Axis.EXPERT, recv_splits, send_splits)
        perm, local_counts = expert_major(recv_counts, sum(recv_splits))
        w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
        ys = expert_swiglu(rows[perm], local_counts, w1, w3, w2)
        ys = ys[torch.argsort(perm)]  # back to source-major
        home = all_to_all_autograd(ys, self.grid, Axis.EXPERT, send_splits, recv_splits)
        return combine(home, order, weights, dtype)

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
