"""Where each parameter lives on the grid, and grid-independent initialisation.

A :class:`Placement` says, for each tensor dimension, which grid axes split it (outer to inner).
Every shard is then a rectangle of the global tensor at a known offset, and an axis not named is
one over which the parameter is replicated. Gradient synchronisation, global-norm clipping and
checkpoints read only this.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from tetrad.grid import Grid
from tetrad.models.meta import materialize
from tetrad.spec import EXPERT_GRID_AXES, GRID_AXES, Axis

# Replicated axes whose ranks see different tokens: gradients are summed over them.
TOKEN_AXES = (Axis.Z, Axis.DATA)


@dataclass(frozen=True)
class Placement:
    """Layout of one parameter on the grid.

    Attributes:
        shape: the global (unsharded) shape.
        split: per tensor dim, the axes splitting it, outer to inner; e.g. a non-transposed
            Linear weight ``[n, k]`` has ``(("y", "z"), ("x",))``: rows in ``G_y`` blocks, each
            block's rows again in ``G_z`` pieces, columns in ``G_x`` blocks.
        sum_axes: further replicated axes whose ranks see other tokens or heads with this
            parameter, so its gradient is summed over them too: Y and X for the MoE router and
            experts on tensor grids (each tensor rank routes its own slice of the tokens,
            :mod:`tetrad.parallel.moe_tensor`), Y for per-head q/k norm weights (heads split
            over Y).
    """

    shape: tuple[int, ...]
    split: tuple[tuple[str, ...], ...]
    sum_axes: tuple[str, ...] = ()

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for dim in self.split for a in dim)

    @property
    def expert_sharded(self) -> bool:
        """Whether the tensor is split over the expert axis (a routed expert's weight): its
        grid is then :data:`tetrad.spec.EXPERT_GRID_AXES`, the data x context ranks seen as
        expert-data x expert."""
        return Axis.EXPERT in self.sharded_axes

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        axes = EXPERT_GRID_AXES if self.expert_sharded else GRID_AXES
        return tuple(a for a in axes if a not in self.sharded_axes)

    @property
    def grad_sum_axes(self) -> tuple[str, ...]:
        """Replicated axes over which the gradient must be summed (they see other tokens):
        Z and data, or Z and expert-data for an expert-sharded weight (each of its ranks
        axis, so no rescaling: losses are sums divided by the global token count), then
        :attr:`sum_axes`."""
        axes = (Axis.Z, Axis.EXPERT_DATA) if self.expert_sharded else TOKEN_AXES
        return tuple(a for a in axes + self.sum_axes if a not in self.sharded_axes)

    def local_slices(self, grid: Grid) -> tuple[slice, ...]:
        """This rank's rectangle of the global tensor, one slice per dim."""
        out = []
        for d, axes in enumerate(self.split + ((),) * (len(self.shape) - len(self.split))):
            parts, index = 1, 0
            for a in axes:
                parts, index = parts * grid.size(a), index * grid.size(a) + grid.coord[a]
            size = self.shape[d] // parts
            out.append(slice(index * size, (index + 1) * size))
        return tuple(out)

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.local_slices(grid))


def sharded_parameter(
    shape: tuple[int, ...],
    split: tuple[tuple[str, ...], ...],
    grid: Grid,
    init: tuple,
    sum_axes: tuple[str, ...] = (),
) -> nn.Parameter:
    """An uninitialised local shard ``Placement(shape, split, sum_axes).local_shape(grid)``
    tagged with its placement and its init rule (see :func:`init_parameters`): on the grid's
    device, or on the meta device inside ``with torch.device("meta")`` (how the models are
    built: :func:`tetrad.models.meta.materialize` then allocates it on the grid's device)."""
    placement = Placement(tuple(shape), split, tuple(sum_axes))
    device = "meta" if torch.get_default_device().type == "meta" else grid.device
    p = nn.Parameter(torch.empty(placement.local_shape(grid), device=device))
    p.placement = placement
    p.init = init
    return p


def _row_seed(seed: int, name: str, row: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    base = int.from_bytes(digest, "little")
    return (base + row * 0x9E3779B97F4A7C15) % (1 << 63)


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, grid: Grid | None = None) -> None:
    """Fill every parameter from ``(seed, parameter name)`` only, whatever the grid.

    Each parameter carries ``init``: ``("normal", std)`` for a weight of 2 or more dims,
    ``("ones",)`` or ``("zeros",)``. A normal weight is drawn as rows of its global tensor
    viewed ``[prod(shape[:-1]), shape[-1]]`` (an expert weight ``[E, F, h]`` has ``E F`` rows);
    row ``r`` from a generator seeded by ``(seed, name, r)``, so a rank draws only the rows of
    its own shard (never the whole model) and a parameter's full value is the same on every
    grid. Parameters without ``placement`` are full tensors. Parameters still on the meta
    device are first given storage on the grid's device (without ``grid``: the device of the
    model's other parameters, else the CPU; :func:`tetrad.models.meta.materialize`).
    """
    real = [p.device for p in model.parameters() if not p.is_meta]
    device = grid.device if grid is not None else (real[0] if real else torch.device("cpu"))
    materialize(model, device)
    for name, p in model.named_parameters():
        kind = getattr(p, "init", ("normal", 0.02) if p.dim() == 2 else ("ones",))
        if kind[0] == "ones":
            p.fill_(1.0)
        elif kind[0] == "zeros":
            p.zero_()
        else:
            placement = getattr(p, "placement", None)
            shape = placement.shape if placement is not None else tuple(p.shape)
            slices = (
                placement.local_slices(grid)
                if placement is not None
                else tuple(slice(0, n) for n in shape)
            )
            p.copy_(_normal_rows(seed, name, shape, slices, kind[1]))


def _normal_rows(
    seed: int, name: str, shape: tuple[int, ...], slices: tuple[slice, ...], std: float
) -> torch.Tensor:
    """The ``slices`` of the seeded normal tensor of ``shape`` (see :func:`init_parameters`):
    every row whose leading indices fall in ``slices[:-1]`` is drawn whole, then cut to
    ``slices[-1]``."""
    lead = [range(s.start, s.stop) for s in slices[:-1]]
    strides = [math.prod(shape[d + 1 : -1]) for d in range(len(lead))]
    out = torch.empty(*(len(r) for r in lead), shape[-1])
    rows = out.view(-1, shape[-1])
    gen = torch.Generator()
    for i, index in enumerate(itertools.product(*lead)):
        gen.manual_seed(
            _row_seed(seed, name, sum(j * st for j, st in zip(index, strides, strict=True)))
        )
        rows[i].normal_(0.0, std, generator=gen)
    return out[..., slices[-1]]
