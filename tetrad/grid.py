"""The process grid ``G_data x G_context x G_z x G_y x G_x`` over a named DeviceMesh.

Rank order follows AxoNN (arXiv 2305.13525, section on the 4D grid): X varies fastest, then Y,
then Z, then context, then data, so an X group is a run of consecutive ranks and sits inside one
node::

    rank = (((data * G_context + context) * G_z + z) * G_y + y) * G_x + x

Context parallelism splits each sequence over ``G_context`` ranks (:mod:`tetrad.parallel.context`);
with ``G_context = 1`` this is AxoNN's 4D grid.

The sizes ``x`` and ``y`` are those of the *roles* of AxoNN's layer pair
(:data:`tetrad.spec.grid.ORIENTATIONS`): under the orientation ``yx`` the ``--grid``'s X dimension
plays the Y role and its Y dimension the X role. The DeviceMesh names its dimensions by role, so
``grid.group("x")`` and ``grid.coord["x"]`` are the X role's everywhere; :attr:`Grid.physical`
is the ``--grid`` as given.

The grid is an explicit object passed to every layer that communicates; there is no global state.
It owns the process's :class:`~tetrad.comm.collectives.CommLog`, into which the collectives of
:mod:`tetrad.comm` record what they send (the collectives know the grid only through their
``Groups`` protocol, so the dependency runs one way: grid -> comm).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tetrad.comm.collectives import CommLog, clock_for
from tetrad.device import local_device
from tetrad.spec.grid import (
    GRID_AXES,
    Axis,
    GridShape,
    check_expert_parallel,
    check_world_size,
    parse_grid,
    physical_axis,
    role_sizes,
)
from tetrad.torch_private import flatten_mesh


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: NCCL for CUDA, gloo for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def init_process_group(device_type: str) -> bool:
    """Make this rank's device current and initialise the default process group from the
    ``torchrun`` environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with
    the backend for ``device_type``, unless one exists; returns whether this call created it.
    On CUDA the group is bound to this rank's GPU (``device_id``): NCCL then creates its
    communicator at once, on the right device, instead of guessing it at the first
    collective (PyTorch warns that a wrong guess can hang)."""
    device = local_device(device_type)
    if dist.is_initialized():
        return False
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend_for(device_type), **bound)
    return True


@dataclass
class Grid:
    """A validated ``G_pipe x G_data x G_context x G_z x G_y x G_x`` grid of processes.

    Attributes:
        data, context, z, y, x: axis sizes ``G_data, G_context, G_z, G_y, G_x`` of the roles.
        pipe: ``G_pipe``, the pipeline stages (outermost; 1: no pipeline); every attribute but
            ``pipe`` and ``world_size`` describes one stage's grid.
        mesh: the DeviceMesh over the ``--grid``'s dimensions of size above 1, named by the
            roles they play: of ``("pipe", "data", "context", "z", "y", "x")``, or ``(...,
            "x", "y")`` under ``yx``; one rank's ``("data",)`` when every size is 1.
        device: this rank's device (``cpu`` or ``cuda:LOCAL_RANK``).
        coord: this rank's coordinate on each axis, e.g. ``coord["x"]``.
        comm: the record of every collective this rank issued, per axis.
        data_group: with ``G_context > 1``, the data x context group (gradient sums).
        expert: ``G_expert``, the expert-parallel size (1: none), folded over the stage's
            ranks, X first (:data:`tetrad.spec.grid.EXPERT_GRID_AXES`): ``coord["expert"]``
            and ``coord["expert_data"]`` are this rank's place on it.
    """

    data: int
    context: int
    z: int
    y: int
    x: int
    mesh: DeviceMesh
    device: torch.device
    coord: dict[str, int] = field(default_factory=dict)
    comm: CommLog = field(default_factory=CommLog)
    data_group: dist.ProcessGroup | None = None
    orientation: str = "xy"
    pipe: int = 1
    expert: int = 1
    _groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, init=False, repr=False)

    @classmethod
    def build(
        cls,
        sizes: GridShape,
        device_type: str = "cpu",
        orientation: str = "xy",
        pipe: int = 1,
        expert: int = 1,
    ) -> Grid:
        """Build the grid over the already-initialised default process group; ``sizes`` are
        the ``--grid``, ``(G_data, G_context, G_z, G_y, G_x)`` or ``(G_data, G_z, G_y, G_x)``,
        ``orientation`` one of :data:`tetrad.spec.grid.ORIENTATIONS` and ``pipe`` the pipeline
        stages ``G_pipe`` (outermost: ``rank = pipe_rank * world / G_pipe + the 5D rank``).

        If no process group exists, one is initialised from the ``torchrun`` environment
        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with the backend for
        ``device_type``.

        ``expert`` is the expert-parallel size ``G_expert`` (:func:`expert_groups`).

        Raises:
            GridError: the product of ``sizes`` differs from the world size, an unknown
                orientation, or ``expert`` does not divide ``G_data G_context G_z G_y G_x``.
        """
        init_process_group(device_type)
        sizes = parse_grid(sizes)
        check_world_size(sizes, dist.get_world_size(), pipe)
        check_expert_parallel(expert, sizes)
        names = tuple(physical_axis(a, orientation) for a in GRID_AXES)  # the roles, in order
        mesh = _mesh(device_type, (pipe, *sizes), ("pipe", *names))
        coord = {a: _local_rank(mesh, a) for a in (*GRID_AXES, Axis.PIPE)}
        data_group = None
        if sizes[1] > 1:  # the data x context group, created on every rank at once
            # a group of its own even when it holds the context group's ranks (G_data = 1):
            # gradient buckets launch as Z reduce-scatters complete, so their order against
            # the context K/V collectives differs across ranks, which one group would deadlock
            dims = ("data", "context") if sizes[0] > 1 else ("context",)
            data_group = flatten_mesh(mesh, dims, "data_context").get_group()
        grid = cls(
            *role_sizes(sizes, orientation),
            mesh=mesh,
            device=local_device(device_type),
            coord=coord,
            data_group=data_group,
            orientation=orientation,
            pipe=pipe,
            expert=expert,
        )
        stage_rank = dist.get_rank() % grid.stage_size  # the --grid's order: X fastest
        grid.coord[Axis.EXPERT] = stage_rank % expert
        grid.coord[Axis.EXPERT_DATA] = stage_rank // expert
        if expert > 1:
            grid._groups.update(expert_groups(grid, expert))
        grid.comm.names = {a: physical_axis(a, orientation) for a in ("x", "y")}
        grid.comm.clock = clock_for(grid.device, dist.get_backend())
        return grid

    def size(self, axis: Axis | str) -> int:
        """Number of ranks in the group of a collective over ``axis``: the axis size, except
        ``data``: ``G_data G_context`` (see :class:`~tetrad.spec.grid.Axis`)."""
        if axis == Axis.DATA:
            return self.data * self.context
        if axis == Axis.EXPERT_DATA:
            return self.stage_size // self.expert
        return getattr(self, axis)

    def group(self, axis: Axis | str) -> dist.ProcessGroup:
        """The process group of this rank's ``axis`` line (all other coordinates fixed); for
        ``data`` the data x context plane."""
        if axis == Axis.DATA and self.context > 1:
            return self.data_group
        if axis not in self._groups:  # DeviceMesh.get_group costs ~10 us; called per collective
            self._groups[axis] = self.mesh.get_group(axis)
        return self._groups[axis]

    @property
    def sizes(self) -> GridShape:
        """The roles' sizes ``(G_data, G_context, G_z, G_y, G_x)`` (what the layers split by)."""
        return (self.data, self.context, self.z, self.y, self.x)

    @property
    def physical(self) -> GridShape:
        """The ``--grid`` this grid was built from (the mesh's sizes, X innermost)."""
        return role_sizes(self.sizes, self.orientation)

    @property
    def dim_names(self) -> tuple[str, ...]:
        """The roles of the ``--grid``'s dimensions in its order, ``pipe`` first: ``("pipe",
        "data", "context", "z", "y", "x")``, or ``(..., "x", "y")`` under ``yx``."""
        return ("pipe", *(physical_axis(a, self.orientation) for a in GRID_AXES))

    @property
    def stage_size(self) -> int:
        """The ranks of one pipeline stage: ``G_data G_context G_z G_y G_x``."""
        return self.data * self.context * self.z * self.y * self.x

    @property
    def world_size(self) -> int:
        """Every rank of the grid: ``G_pipe G_data G_context G_z G_y G_x``."""
        return self.pipe * self.data * self.context * self.z * self.y * self.x

    @property
    def batch_shards(self) -> int:
        """How many pieces the global batch is split into: ``G_data * G_z``."""
        return self.data * self.z

    @property
    def batch_rank(self) -> int:
        """Index of this rank's batch piece, ``data * G_z + z`` (AxoNN's loader order)."""
        return self.coord["data"] * self.z + self.coord["z"]

    def __str__(self) -> str:
        d, c, z, y, x = self.physical
        ctx = f" context={c}" if c > 1 else ""
        turned = " (orientation yx)" if self.orientation == "yx" else ""
        pipe = f"pipe={self.pipe} " if self.pipe > 1 else ""
        ep = f" expert={self.expert}" if self.expert > 1 else ""
        return f"{pipe}data={d}{ctx} z={z} y={y} x={x}{ep}{turned}"


def _mesh(device_type: str, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The DeviceMesh over the dimensions of ``sizes`` above 1 (ranks in row-major order of all
    of them), or one rank's 1D ``data`` mesh. A size-1 dimension gets no process group: it
    would carry no collective, and on gloo every group runs a thread that wakes every 10 ms
    (four ranks on two cores lost 4% of their step to seven idle groups)."""
    kept = [(n, s) for n, s in zip(names, sizes, strict=True) if s > 1] or [("data", 1)]
    shape, kept_names = (s for _, s in kept), (n for n, _ in kept)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(kept_names))


def _local_rank(mesh: DeviceMesh, name: str) -> int:
    """This rank's coordinate on the mesh dimension ``name``; 0 on one the mesh left out."""
    return mesh.get_local_rank(name) if name in (mesh.mesh_dim_names or ()) else 0


def expert_groups(grid: Grid, expert: int) -> dict[str, dist.ProcessGroup]:
    """Create the expert-parallel and expert-data process groups of every rank (a collective
    over the world) and return this rank's, keyed ``"expert"`` and ``"expert_data"``.

    The stage rank ``r`` (X fastest, :data:`tetrad.spec.grid.GRID_AXES`) splits as ``r =
    expert_data G_expert + expert`` (:data:`tetrad.spec.grid.EXPERT_GRID_AXES`): an expert group
    is ``G_expert`` consecutive ranks of a stage (X, then Y, Z, context, data: Megatron-Core's
    folding, EP innermost after an expert tensor parallelism of 1), an expert-data group the
    ``G_stage / G_expert`` ranks of one expert coordinate, at stride ``G_expert``.
    """
    ranks = torch.arange(grid.world_size).view(grid.pipe, -1, expert)  # [pipe, ed, ep]
    out = {}
    for axis, dim in ((Axis.EXPERT, 2), (Axis.EXPERT_DATA, 1)):
        lines = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]).tolist()
        if len(lines[0]) == 1:
            continue
        mine, _ = dist.new_subgroups_by_enumeration(lines)
        out[axis] = mine
    return out
