"""Gradient synchronisation and exact global gradient-norm clipping, read from placements."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.spec import Axis


def sync_gradients(model: nn.Module, grid: Grid, data_reduced: set[int] = frozenset()) -> None:
    """Sum every gradient over the replicated axes whose ranks saw other tokens (Z, and data,
    whose group includes the context axis: :class:`tetrad.spec.Axis`).

    Linear and embedding weights are sharded over Z (their reduce-scatter already summed Z), so
    they are summed over data only; biases and norm weights over Z and data. Axes X and Y need
    nothing: their ranks compute identical gradients for what they replicate. Gradients with the
    same axes are flattened into one buffer per axis set (few, large collectives).
    Losses are sums over tokens divided by the global token count, so the sum is the mean.
    Parameters whose ``id`` is in ``data_reduced`` were already summed over data (by the
    overlapped bucketed all-reduce) and are summed over the remaining axes only.
    """
    buckets: dict[tuple[str, ...], list[torch.Tensor]] = defaultdict(list)
    for p in model.parameters():
        if p.grad is not None:
            axes = p.placement.grad_sum_axes
            if id(p) in data_reduced:
                axes = tuple(a for a in axes if a != Axis.DATA)
            buckets[axes].append(p.grad)
    for axes, grads in buckets.items():
        axes = tuple(a for a in axes if grid.size(a) > 1)
        if not axes:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        for a in axes:
            all_reduce(flat, grid, a)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def global_grad_norm(model: nn.Module, grid: Grid) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, identical on every rank.

    Each replicated copy is counted once: a rank adds a parameter's local sum of squares only if
    its coordinate is 0 on every axis that replicates the parameter; the sum (float64) is
    all-reduced over the world. With data parallelism alone (``G_z G_y G_x = 1``) every rank
    holds the whole, identical gradient (after :func:`sync_gradients`), so each computes the norm
    itself and nothing is all-reduced (as DDP with ``torch.nn.utils.clip_grad_norm_``). Call
    after :func:`sync_gradients`. The per-tensor norms are one multi-tensor operation
    (``torch._foreach_norm``), as in ``torch.nn.utils.clip_grad_norm_``. With pipeline stages
    ``model`` holds this rank's parts and the world sum adds the stages.
    """
    # stages hold different weights, and so do expert-parallel ranks
    sharded = grid.z * grid.y * grid.x > 1 or grid.pipe > 1 or grid.expert > 1
    local = () if sharded else (Axis.DATA, Axis.CONTEXT)  # each of their ranks counts its own
    grads = [
        p.grad.detach()
        for p in model.parameters()
        if p.grad is not None
        and all(grid.coord[a] == 0 for a in p.placement.replicated_axes if a not in local)
    ]
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    if grads:
        total += torch.stack(torch._foreach_norm(grads)).double().pow(2).sum()
    if sharded:
        all_reduce(total, grid, Axis.WORLD)
    return total.sqrt().float()


def clip_grad_norm(model: nn.Module, grid: Grid, max_norm: float) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; return the norm before.

    Same rule as ``torch.nn.utils.clip_grad_norm_``: ``coef = min(1, max_norm / (norm + 1e-6))``.
    The scale stays on the device (no host synchronisation) and is applied with one
    multi-tensor multiply.
    """
    norm = global_grad_norm(model, grid)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if max_norm > 0 and grads:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
    return norm
