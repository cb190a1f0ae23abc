"""A global batch on this rank: its samples, their inputs and targets per sequence chunk, on the
device, and the losses summed back over the ranks that saw other samples. Shared by the plain
training step (:mod:`tetrad.train.step`) and the pipeline's (:mod:`tetrad.pipeline.step`)."""

from __future__ import annotations

import torch

from tetrad.comm import Handle, all_reduce
from tetrad.grid import Grid
from tetrad.parallel.context import split_sequence
from tetrad.spec.grid import Axis


def local_samples(batch: torch.Tensor, grid: Grid) -> torch.Tensor:
    """This rank's share of a global batch ``[B, ...]``: samples
    ``[r*B/(G_data G_z), (r+1)*B/(G_data G_z))`` with ``r = data*G_z + z``."""
    n = batch.shape[0] // grid.batch_shards
    return batch[grid.batch_rank * n : (grid.batch_rank + 1) * n]


def inputs_targets(mb: torch.Tensor, grid: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[b, S/G_context]`` of this rank from its samples ``[b, S+1]``
    (its two sequence chunks, :func:`tetrad.parallel.context.split_sequence`)."""
    return split_sequence(mb[:, :-1], grid), split_sequence(mb[:, 1:], grid)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory, without blocking the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def sum_over_batch_axes(
    t: torch.Tensor, grid: Grid, async_op: bool = False
) -> torch.Tensor | Handle:
    """``t`` (a 0-dim loss sum) summed in place over the axes whose ranks see other samples or
    tokens: Z, then data x context. ``async_op``: the sum over data x context is left in
    flight, a :class:`~tetrad.comm.Handle` returned (wait it before reading ``t``)."""
    all_reduce(t, grid, Axis.Z)
    return all_reduce(t, grid, Axis.DATA, async_op=async_op)  # data x context
