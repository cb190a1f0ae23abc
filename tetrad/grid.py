"""The 4D process grid ``G_data x G_z x G_y x G_x`` over a named DeviceMesh.

Rank order follows AxoNN (arXiv 2305.13525, section on the 4D grid): X varies fastest, then Y,
then Z, then data, so an X group is a run of consecutive ranks and sits inside one node::

    rank = ((data * G_z + z) * G_y + y) * G_x + x

The grid is an explicit object passed to every layer that communicates; there is no global state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tetrad.comm.collectives import CommLog
from tetrad.device import local_device

AXES = ("data", "z", "y", "x")


class GridError(ValueError):
    """A grid that does not match the world size or has a non-positive axis."""


def parse_grid(text: str | tuple[int, ...] | list[int]) -> tuple[int, int, int, int]:
    """Parse ``"DATA,Z,Y,X"`` (or a 4-sequence) into ``(G_data, G_z, G_y, G_x)``.

    Raises:
        GridError: not four positive integers.
    """
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",")]
    else:
        parts = list(text)
    try:
        sizes = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        sizes = ()
    if len(sizes) != 4 or min(sizes) < 1:
        raise GridError(
            f"grid {text!r} is not DATA,Z,Y,X with four positive integers (for example 1,2,1,2)"
        )
    return sizes  # type: ignore[return-value]


def check_world_size(sizes: tuple[int, int, int, int], world_size: int) -> None:
    """Raise a :class:`GridError` printing the product equation if it is not ``world_size``."""
    d, z, y, x = sizes
    if d * z * y * x != world_size:
        raise GridError(
            f"grid data*z*y*x = {d}*{z}*{y}*{x} = {d * z * y * x}, but world size is "
            f"{world_size}: choose a --grid whose product is {world_size}"
        )


def backend_for(device_type: str) -> str:
    """The collective backend for a device type: NCCL for CUDA, gloo for CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class Grid:
    """A validated ``G_data x G_z x G_y x G_x`` grid of processes.

    Attributes:
        data, z, y, x: axis sizes ``G_data, G_z, G_y, G_x``.
        mesh: the DeviceMesh with dims named ``("data", "z", "y", "x")``.
        device: this rank's device (``cpu`` or ``cuda:LOCAL_RANK``).
        coord: this rank's coordinate on each axis, e.g. ``coord["x"]``.
        comm: the record of every collective this rank issued, per axis.
    """

    data: int
    z: int
    y: int
    x: int
    mesh: DeviceMesh
    device: torch.device
    coord: dict[str, int] = field(default_factory=dict)
    comm: CommLog = field(default_factory=CommLog)

    @classmethod
    def build(cls, sizes: tuple[int, int, int, int], device_type: str = "cpu") -> Grid:
        """Build the grid over the already-initialised default process group.

        If no process group exists, one is initialised from the ``torchrun`` environment
        (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) with the backend for
        ``device_type``.

        Raises:
            GridError: the product of ``sizes`` differs from the world size.
        """
        device = local_device(device_type)
        if not dist.is_initialized():
            dist.init_process_group(backend_for(device_type))
        check_world_size(sizes, dist.get_world_size())
        mesh = init_device_mesh(device_type, sizes, mesh_dim_names=AXES)
        coord = {a: mesh.get_local_rank(a) for a in AXES}
        return cls(*sizes, mesh=mesh, device=device, coord=coord)

    def size(self, axis: str) -> int:
        """Number of ranks along ``axis`` (one of ``data, z, y, x``)."""
        return getattr(self, axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank's ``axis`` line (all other coordinates fixed)."""
        return self.mesh.get_group(axis)

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.data, self.z, self.y, self.x)

    @property
    def world_size(self) -> int:
        return self.data * self.z * self.y * self.x

    @property
    def batch_shards(self) -> int:
        """How many pieces the global batch is split into: ``G_data * G_z``."""
        return self.data * self.z

    @property
    def batch_rank(self) -> int:
        """Index of this rank's batch piece, ``data * G_z + z`` (AxoNN's loader order)."""
        return self.coord["data"] * self.z + self.coord["z"]

    def __str__(self) -> str:
        return f"data={self.data} z={self.z} y={self.y} x={self.x}"
