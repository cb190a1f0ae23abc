"""Gradient synchronisation and exact global gradient-norm clipping, read from placements."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.parallel.masters import grad_of, reduce_dtype
from tetrad.parallel.zero import DataShards
from tetrad.spec.grid import Axis
from tetrad.torch_private import foreach_mul_, foreach_norm

SUMS_OVER_DATA = (Axis.DATA, Axis.EXPERT_DATA)
"""The axes whose gradient sums run in the policy's ``grad_reduce`` format
(:func:`tetrad.parallel.masters.reduce_dtype`): data x context, and expert-data, over which the
expert-sharded weights are summed (Megatron-LM reduces its expert-parallel gradient buffers in
the same format as the others); Z, Y and X sum in the gradients' own format."""


def sync_gradients(
    model: nn.Module,
    grid: Grid,
    data_reduced: set[int] = frozenset(),
    shards: DataShards | None = None,
) -> None:
    """Sum every gradient over the replicated axes whose ranks saw other tokens (Z, and data,
    whose group includes the context axis: :class:`tetrad.spec.grid.Axis`).

    Linear and embedding weights are sharded over Z (their reduce-scatter already summed Z), so
    they are summed over data only; biases and norm weights over Z and data. Axes X and Y need
    nothing: their ranks compute identical gradients for what they replicate. Gradients with the
    same axes are flattened into one buffer per axis set (few, large collectives).
    Losses are sums over tokens divided by the global token count, so the sum is the mean.
    Parameters whose ``id`` is in ``data_reduced`` were already summed over data (by the
    overlapped bucketed all-reduce) and are summed over the remaining axes only.

    With ``shards`` (the sharded optimizer, :mod:`tetrad.parallel.zero`) the sum over data is a
    reduce-scatter (:meth:`DataShards.reduce_scatter`, after the other axes' all-reduces) that
    leaves each rank its pieces in ``shards.grads``; the ``data_reduced`` parameters were
    reduce-scattered by the buckets, and what is left to sum of them is summed on the pieces.
    An MoE model's expert-sharded weights, summed over expert-data alone, are reduce-scattered
    over it likewise (:attr:`DataShards.experts`, where that group has more than one rank).
    """
    buckets: dict[tuple[str, ...], list[nn.Parameter]] = defaultdict(list)
    # with shards, a parameter the buckets reduce-scattered has its piece and no gradient
    # (:func:`grad_of`)
    reduced = shards.grads if shards is not None else {}
    for p in model.parameters():
        if grad_of(p) is not None or id(p) in reduced:
            axes = p.placement.grad_sum_axes
            if id(p) in data_reduced:  # the buckets' data sum, or the experts' expert-data one
                axes = tuple(a for a in axes if a not in SUMS_OVER_DATA)
            buckets[axes].append(p)
    for axes, params in buckets.items():
        # data last: with shards its sum is the reduce-scatter that ends the loop
        axes = tuple(a for a in axes if grid.size(a) > 1 and a != Axis.DATA) + tuple(
            a for a in axes if a == Axis.DATA and grid.size(a) > 1
        )
        if not axes:
            continue
        pieces = shards.grads if shards is not None else {}  # those reduced over data
        grads = [pieces.get(id(p), grad_of(p)) for p in params]
        if shards is not None and axes == (Axis.DATA,):  # packed as they are, no flat copy
            shards.take(params, shards.reduce_scatter(params, grads))
            continue
        experts = shards.experts if shards is not None else None
        if experts is not None and axes == (Axis.EXPERT_DATA,):  # the expert-sharded weights
            experts.take(params, experts.reduce_scatter(params, grads))
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        for a in axes:
            if a == Axis.DATA and shards is not None:  # the last of TOKEN_AXES
                shards.take(params, shards.reduce_scatter(params, _split(flat, grads)))
                break
            if a in SUMS_OVER_DATA and reduce_dtype(params[0]) != flat.dtype:
                flat.copy_(all_reduce(flat.to(reduce_dtype(params[0])), grid, a))
            else:
                all_reduce(flat, grid, a)
        else:
            _copy_back(flat, grads)


def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into views shaped as ``like``."""
    out, offset = [], 0
    for g in like:
        out.append(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return out


def _copy_back(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    for g, part in zip(grads, _split(flat, grads), strict=True):
        g.copy_(part)


def global_grad_norm(
    model: nn.Module, grid: Grid, shards: DataShards | None = None
) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, identical on every rank.

    Each replicated copy is counted once: a rank adds a parameter's local sum of squares only if
    its coordinate is 0 on every axis that replicates the parameter; the sum (float64) is
    all-reduced over the world. With data parallelism alone (``G_z G_y G_x = 1``) every rank
    holds the whole, identical gradient (after :func:`sync_gradients`), so each computes the norm
    itself and nothing is all-reduced (as DDP with ``torch.nn.utils.clip_grad_norm_``). Call
    after :func:`sync_gradients`. The per-tensor norms are one multi-tensor operation
    (``torch._foreach_norm``), as in ``torch.nn.utils.clip_grad_norm_``. With pipeline stages
    ``model`` holds this rank's parts and the world sum adds the stages.

    With ``shards`` (``G_data G_context > 1``) a rank holds its pieces of the reduced gradients
    (:mod:`tetrad.parallel.zero`), which the data x context ranks split without overlap: each
    counts its own and the sum is always all-reduced over the world.
    """
    zero = shards is not None and shards.size > 1
    # stages hold different weights, and so do expert-parallel ranks
    sharded = zero or grid.z * grid.y * grid.x > 1 or grid.pipe > 1 or grid.expert > 1
    # axes whose ranks count their own copy or piece (expert-data: the experts' pieces)
    own = (Axis.DATA, Axis.CONTEXT, Axis.EXPERT_DATA)
    grads = []
    for p, g in _step_grads(model, shards):
        local = own if (id(p) in shards.grads if zero else not sharded) else ()
        if all(grid.coord[a] == 0 for a in p.placement.replicated_axes if a not in local):
            grads.append(g.detach())
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    if grads:
        total += torch.stack(foreach_norm(grads)).double().pow(2).sum()
    if sharded:
        all_reduce(total, grid, Axis.WORLD)
    return total.sqrt().float()


def _step_grads(
    model: nn.Module, shards: DataShards | None
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """``(param, the gradient the optimizer uses)``: its piece with ``shards``, else ``.grad``."""
    pieces = shards.grads if shards is not None else {}
    out = []
    for p in model.parameters():
        g = pieces.get(id(p), grad_of(p))
        if g is not None:
            out.append((p, g))
    return out


def clip_grad_norm(
    model: nn.Module, grid: Grid, max_norm: float, shards: DataShards | None = None
) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; return the norm before.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
    The scale stays on the device (no host synchronisation) and is applied with one
    multi-tensor multiply. With ``shards`` the pieces are scaled (:func:`global_grad_norm`).
    """
    norm = global_grad_norm(model, grid, shards)
    grads = [g for _, g in _step_grads(model, shards)]
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
