"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Every shard is described to DCP as a DTensor of the parameter's global shape, so DCP stores
global offsets: a checkpoint can be read back by one process (``tetrad generate``) or by another
grid. A checkpoint is written into ``step_NNNNNNN.tmp`` and renamed when every rank is done;
``latest`` names the newest complete one and is replaced atomically, so a crash mid-write leaves
the previous checkpoint in charge.

Layout: ``RUN_DIR/checkpoints/step_0000300/`` (DCP files) and ``RUN_DIR/checkpoints/latest``.
Keys: ``model.<param>``, ``optim.<param>.exp_avg``, ``optim.<param>.exp_avg_sq``,
``optim.<param>.step`` and ``step``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tetrad.grid import Grid
from tetrad.parallel.placement import Placement
from tetrad.spec import GRID_AXES, TetradError


class CheckpointError(TetradError):
    """A checkpoint that is missing, incomplete or does not match the model."""


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None if it has none.

    Raises:
        CheckpointError: ``latest`` names a folder that is missing or incomplete.
    """
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = pointer.parent / pointer.read_text().strip()
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint {path} named by {pointer} is missing or incomplete: "
            "restore the folder, or delete the pointer to start over"
        )
    return path


class Checkpointer:
    """Saves and loads the model and AdamW state of one grid."""

    def __init__(self, run_dir: str | Path, grid: Grid):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.grid = grid
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}

    def _dtensor(self, t: torch.Tensor, placement: Placement) -> DTensor:
        order = placement.replicated_axes + placement.sharded_axes
        if order not in self._meshes:
            ranks = torch.arange(self.grid.world_size).view(self.grid.sizes)
            perm = [GRID_AXES.index(a) for a in order]
            self._meshes[order] = DeviceMesh(
                self.grid.device.type, ranks.permute(perm), mesh_dim_names=order
            )
        dim_of = {a: d for d, axes in enumerate(placement.split) for a in axes}
        places = [Shard(dim_of[a]) if a in dim_of else Replicate() for a in order]
        full = torch.empty(placement.shape, device="meta")
        return DTensor.from_local(
            t, self._meshes[order], places, run_check=False, shape=full.shape, stride=full.stride()
        )

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
        state: dict = {"step": torch.tensor(step)}
        for name, p in model.named_parameters():
            state[f"model.{name}"] = self._dtensor(p.data, p.placement)
            st = optimizer.state.setdefault(p, {})
            if "exp_avg" not in st:  # before the first step: load into fresh state
                st.update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(p),
                    exp_avg_sq=torch.zeros_like(p),
                )
            for k in ("exp_avg", "exp_avg_sq"):
                state[f"optim.{name}.{k}"] = self._dtensor(st[k], p.placement)
            state[f"optim.{name}.step"] = st["step"]
        return state

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> Path:
        """Write the state after ``step`` optimizer steps; returns the checkpoint folder."""
        final = self.dir / f"step_{step:07d}"
        tmp = final.with_name(final.name + ".tmp")
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(self._state(model, optimizer, step), checkpoint_id=tmp)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            pointer = self.dir / "latest.tmp"
            pointer.write_text(final.name + "\n")
            os.replace(pointer, self.dir / "latest")
        dist.barrier()
        return final

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> int:
        """Load model and optimizer state in place; returns the step it was saved at."""
        state = self._state(model, optimizer, 0)
        try:
            dcp.load(state, checkpoint_id=path)
        except Exception as e:  # DCP raises a CheckpointException carrying every rank's error
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"cannot load checkpoint {path} ({first}): it is corrupt "
                "or from another model; use a fresh --run-dir"
            ) from None
        for name, p in model.named_parameters():
            p.data.copy_(state[f"model.{name}"].to_local())
            st = optimizer.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                st[k].copy_(state[f"optim.{name}.{k}"].to_local())
            st["step"] = state[f"optim.{name}.step"]
        return int(state["step"])
