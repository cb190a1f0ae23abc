"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): saved synchronously or in the
background, committed atomically, verified and resharded on load.

Every shard is described to DCP as a DTensor of the parameter's global shape, so DCP stores
global offsets: a checkpoint can be read back by one process (``tetrad generate``, ``tetrad
export``) or by any other grid. The folder layout, ``tetrad.json`` and the commit order are in
:mod:`tetrad.train.checkpoint_dir`.

Keys: ``model.<param>``, ``optim.<param>.exp_avg``, ``optim.<param>.exp_avg_sq``,
``optim.<param>.step``, ``step`` and ``rng.<rank>`` (each rank's torch CPU generator state,
restored when the world size is unchanged). ``model.<param>`` holds the fp32 weights AdamW
updates, whatever the weights' stored format: the parameters themselves, or the optimizer's fp32
masters when they are stored in bf16 (:mod:`tetrad.parallel.masters`), so keys and formats do
not depend on the policy and a run resumes with either storage. The data position is the
step: the batch of step ``s`` depends only on ``(seed, s)``
(:func:`tetrad.data.loader.sample_batch`), whatever the data-parallel split, so it carries over
to any grid. The optimizer's states are stored as whole
local tensors with or without the sharded optimizer (which gathers them over data x context to
save and keeps its pieces on load: :class:`tetrad.parallel.zero.ShardedAdamW`), so a run resumes
sharded or not, on any grid.

With ``async_save``, :meth:`Checkpointer.save` costs the loop only the copy of the shards to host
memory (DCP's ``async_save``, on its own gloo group); a background thread writes the files and
hashes this rank's shards; :meth:`Checkpointer.poll` commits the checkpoint at the next step
boundary where every rank has finished, and :meth:`Checkpointer.wait` before the next save and
at the end.
"""

from __future__ import annotations

import functools
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tetrad.grid import Grid
from tetrad.parallel.masters import MasterAdamW, place_steps
from tetrad.parallel.placement import Placement
from tetrad.spec.grid import Axis
from tetrad.torch_private import layout_mesh
from tetrad.train.checkpoint_dir import (
    CheckpointError,
    check_files,
    commit,
    file_digest,
    latest_checkpoint,
    leftovers,
    rank_files,
    read_meta,
    step_dir,
    write_meta,
)
from tetrad.train.legacy_layout import (
    interleaved_placement,
    is_interleaved,
    stacked_from_interleaved,
)

__all__ = ["CheckpointError", "Checkpointer", "latest_checkpoint"]


@dataclass
class _Pending:
    """A save whose files are being written: ``digests`` resolves to this rank's
    ``{file name: {"bytes", "sha256"}}`` once they are on disk."""

    step: int
    tmp: Path
    digests: Future
    started: float


class Checkpointer:
    """Saves and loads the model and AdamW state of one grid (construct on every rank).

    Args:
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints``.
        grid: this job's grid.
        meta: what ``tetrad.json`` records besides the step and the files (model config,
            grid, tokenizer hash, tetrad version, data settings).
        keep_last: complete checkpoints kept (0: all); older ones are removed only after a
            newer one is complete.
        async_save: write in the background (see the module docstring).
    """

    def __init__(
        self,
        run_dir: str | Path,
        grid: Grid,
        *,
        meta: dict | None = None,
        keep_last: int = 0,
        async_save: bool = False,
    ):
        self.run_dir = Path(run_dir)
        self.grid = grid
        self.meta = meta or {}
        self.keep_last = keep_last
        self.async_save = async_save
        self._meshes: dict[tuple[str, ...], DeviceMesh] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tetrad-ckpt")
        self._pending: _Pending | None = None

    # DCP's collectives (run by a background thread when saving asynchronously) and ours each
    # get a gloo group of their own, apart from the training's collectives; made at their first
    # use (a collective of every rank, as each use is), since every gloo group runs a thread
    # that wakes every 10 ms, which a CPU run pays for in every step.
    @functools.cached_property
    def _io(self) -> dist.ProcessGroup:
        return dist.new_group(backend="gloo")

    @functools.cached_property
    def _ctl(self) -> dist.ProcessGroup:
        return dist.new_group(backend="gloo")

    def _mesh(self, order: tuple[str, ...]) -> DeviceMesh:
        """The ranks of this rank's stage laid out as the ``--grid``, dims in role ``order``."""
        if order not in self._meshes:
            # this rank's stage only: the mesh has no process groups (it only lays out the
            # pieces; DCP plans and reads with its own group), so nothing is collective
            ranks = torch.arange(self.grid.world_size).view(self.grid.pipe, *self.grid.physical)
            names = self.grid.dim_names[1:]
            if Axis.EXPERT in order:  # the stage's ranks seen as expert-data x expert
                ranks = ranks.view(self.grid.pipe, -1, self.grid.expert)
                names = (Axis.EXPERT_DATA.value, Axis.EXPERT.value)
            stage = ranks[self.grid.coord[Axis.PIPE]]
            # a copy with row-major strides: torch 2.11 takes a mesh's layout from its tensor's
            # strides (a permuted size-1 dim keeps its old stride, even through contiguous())
            stage = stage.permute([names.index(a) for a in order])
            self._meshes[order] = layout_mesh(
                self.grid.device.type, stage.clone(memory_format=torch.contiguous_format), order
            )
        return self._meshes[order]

    def _dtensor(self, t: torch.Tensor, placement: Placement) -> DTensor:
        order = placement.replicated_axes + placement.sharded_axes
        self._mesh(order)
        dim_of = {a: d for d, axes in enumerate(placement.split) for a in axes}
        places = [Shard(dim_of[a]) if a in dim_of else Replicate() for a in order]
        full = torch.empty(placement.shape, device="meta")
        return DTensor.from_local(
            t.view(placement.local_shape(self.grid)),  # a stacked weight's 2D storage as 3D
            self._meshes[order],
            places,
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )

    def _make_meshes(self, model: nn.Module) -> None:
        """Build the DeviceMesh of every placement order of the model, in one order on every
        rank (building a mesh creates process groups, a collective over the world): pipeline
        stages hold different parameters, so the orders are gathered first."""
        mine = sorted(
            {
                t.placement.replicated_axes + t.placement.sharded_axes
                for _, t in _placed_tensors(model)
            }
        )
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self._ctl)
        for order in sorted({tuple(o) for orders in every for o in orders}):
            self._mesh(order)

    def _state(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
        if not self._meshes:
            self._make_meshes(model)
        state: dict = {"step": torch.tensor(step)}
        for name, b in _placed_buffers(model):
            state[f"model.{name}"] = self._dtensor(b, b.placement)
        named = list(model.named_parameters())
        for (name, p), st in zip(named, _optimizer_states(optimizer, named), strict=True):
            state[f"model.{name}"] = self._dtensor(st.get("master", p.data), p.placement)
            for k in ("exp_avg", "exp_avg_sq"):
                state[f"optim.{name}.{k}"] = self._dtensor(st[k], p.placement)
            state[f"optim.{name}.step"] = st["step"]
        return state

    def _interleaved(self, model: nn.Module, state: dict, path: Path) -> dict:
        """The stacked weights that the checkpoint at ``path`` saved in the old interleaved
        layout (:mod:`tetrad.train.legacy_layout`): each such entry of ``state`` is replaced
        by a tensor of that layout to load into, and returned as ``{key: (today's, old)}``."""
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        out = {}
        for name, p in model.named_parameters():
            for key in (f"model.{name}", f"optim.{name}.exp_avg", f"optim.{name}.exp_avg_sq"):
                if key in saved and is_interleaved(p.placement, tuple(saved[key].size)):
                    new = state[key]
                    rows = torch.empty_like(new.to_local()).view(p.shape)
                    out[key] = (new, self._dtensor(rows, interleaved_placement(p.placement)))
                    state[key] = out[key][1]
        return out

    def _rng_key(self) -> str:
        return f"rng.{dist.get_rank()}"

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Start saving the state after ``step`` optimizer steps (collective); :meth:`poll` or
        :meth:`wait` commits it (a pending earlier save is committed first).

        Synchronous: returns once the files are written. Asynchronous: returns once the shards
        are copied to host memory, the files are written in the background.
        """
        self.wait()
        t0 = time.perf_counter()
        tmp = step_dir(self.run_dir, step).with_suffix(".tmp")
        if dist.get_rank() == 0:
            for old in leftovers(self.run_dir):
                shutil.rmtree(old, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=self._ctl)
        state = self._state(model, optimizer, step)
        state[self._rng_key()] = torch.get_rng_state()
        if self.async_save:
            written = dcp.async_save(state, checkpoint_id=tmp, process_group=self._io)
            digests = self._pool.submit(lambda: (written.result(), self._digests(tmp))[1])
        else:
            dcp.save(state, checkpoint_id=tmp, process_group=self._io)
            digests = Future()
            digests.set_result(self._digests(tmp))
        self._pending = _Pending(step, tmp, digests, t0)

    def _digests(self, tmp: Path) -> dict[str, dict]:
        return {f.name: file_digest(f) for f in rank_files(tmp, dist.get_rank())}

    def poll(self) -> tuple[Path, float] | None:
        """Commit the pending save if every rank has written its files (collective, does not
        wait for the files); returns what :meth:`wait` returns, or None."""
        if self._pending is None:
            return None
        done = torch.tensor([int(self._pending.digests.done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._ctl)
        return self.wait() if done.item() else None

    def wait(self) -> tuple[Path, float] | None:
        """Wait for the pending save and commit it (collective): rank 0 writes ``tetrad.json``
        with every rank's file digests, renames the folder and moves ``latest``. Returns the
        complete checkpoint folder and the seconds since the save started, or None if no save
        was pending.

        Raises:
            Exception: what writing raised on this rank (e.g. a full disk).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        mine = pending.digests.result()
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self._ctl)
        final = pending.tmp.with_suffix("")
        if dist.get_rank() == 0:
            files = {name: d for rank_digests in every for name, d in rank_digests.items()}
            write_meta(pending.tmp, self.meta | {"step": pending.step}, files)
            commit(pending.tmp, self.keep_last)
        dist.barrier(group=self._ctl)
        return final, time.perf_counter() - pending.started

    def close(self) -> tuple[Path, float] | None:
        """Commit a pending save (returns what :meth:`wait` returns) and stop the background
        thread."""
        done = self.wait()
        self._pool.shutdown()
        return done

    def verify(self, path: Path) -> dict | None:
        """Check every file of the checkpoint at ``path`` against the sizes and SHA-256 its
        ``tetrad.json`` recorded, the files spread over the ranks (collective). Returns the
        metadata (None for a checkpoint without ``tetrad.json``).

        Raises:
            CheckpointError: on every rank, naming the first missing, truncated or corrupt file.
        """
        meta = read_meta(path)
        if meta is None:
            return None
        names = sorted(meta.get("files", {}))
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = None
        try:
            check_files(path, meta, names[rank::world], digest=True)
        except CheckpointError as e:
            problem = str(e)
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=self._ctl)
        first = next((p for p in problems if p), None)
        if first:
            raise CheckpointError(first)
        return meta

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> int:
        """Verify the checkpoint at ``path``, then load the model and optimizer state in place
        (resharded from whatever grid saved it) and, on an unchanged world size, this rank's
        RNG state. Returns the step it was saved at (collective).

        Raises:
            CheckpointError: a damaged file (named), or a checkpoint DCP cannot read into this
                model.
        """
        meta = self.verify(path)
        state = self._state(model, optimizer, 0)
        same_world = meta is not None and _world(meta.get("grid")) == dist.get_world_size()
        if same_world:
            state[self._rng_key()] = torch.get_rng_state()
        try:
            old = self._interleaved(model, state, path)
            dcp.load(state, checkpoint_id=path, process_group=self._io)
            for key, rows in old.items():  # w13 saved interleaved: this rank's rows, stacked
                state[key] = rows[0]
                rows[0].to_local().copy_(stacked_from_interleaved(rows[1].to_local()))
        except Exception as e:  # DCP raises a CheckpointException carrying every rank's error
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CheckpointError(
                f"cannot load checkpoint {path} ({first}): it is corrupt "
                "or from another model; use a fresh --run-dir"
            ) from None
        for name, b in _placed_buffers(model):
            b.copy_(state[f"model.{name}"].to_local())
        named = list(model.named_parameters())
        loaded = []
        for name, p in named:
            weights = state[f"model.{name}"].to_local().view(p.shape)  # stacked: 3D -> stored 2D
            if not isinstance(optimizer, MasterAdamW):
                p.data.copy_(weights)
            loaded.append({k: state[f"optim.{name}.{k}"] for k in ("exp_avg", "exp_avg_sq")})
            loaded[-1] = {k: v.to_local().view(p.shape) for k, v in loaded[-1].items()}
            loaded[-1] |= {"step": state[f"optim.{name}.step"], "master": weights}
        _load_optimizer_states(optimizer, named, loaded)
        if same_world:
            torch.set_rng_state(state[self._rng_key()])
        return int(state["step"])


def _optimizer_states(optimizer: torch.optim.Optimizer, named: list) -> list[dict]:
    """``{"step", "exp_avg", "exp_avg_sq"}`` of each parameter of ``named`` as whole local
    tensors, with ``master`` (the fp32 weights) where they are not the parameter: the sharded
    optimizer's gathered over data (collective,
    :meth:`tetrad.parallel.zero.ShardedAdamW.full_states`), AdamW's own state otherwise (made
    now, zero, before the first step). The keys are the same with or without sharding."""
    params = [p for _, p in named]
    if isinstance(optimizer, MasterAdamW):
        return optimizer.full_states(params)
    out = []
    for p in params:
        st = optimizer.state.setdefault(p, {})
        if "exp_avg" not in st:  # before the first step: load into fresh state
            st.update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
            )
        out.append(st)
    place_steps(optimizer)  # fused AdamW on CUDA keeps it on the device: load into it there
    return out


def _load_optimizer_states(optimizer: torch.optim.Optimizer, named: list, loaded: list) -> None:
    """Set the optimizer's state from the whole local tensors ``loaded`` (one dict per
    parameter of ``named``, with its fp32 ``master`` weights): the sharded optimizer keeps this
    rank's pieces, the masters and the stored weights follow."""
    params = [p for _, p in named]
    if isinstance(optimizer, MasterAdamW):
        optimizer.load_full_states(params, loaded)
        return
    for p, full in zip(params, loaded, strict=True):
        st = optimizer.state[p]
        for k in ("exp_avg", "exp_avg_sq"):
            st[k].copy_(full[k])
        st["step"] = full["step"]
    place_steps(optimizer)


def _placed_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers saved with the parameters: those with a ``placement`` (MoE routers'
    selection biases, :meth:`tetrad.parallel.model.ParallelLlama._place_buffers`)."""
    return [(n, b) for n, b in model.named_buffers() if hasattr(b, "placement")]


def _placed_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and placed buffers, with their names."""
    return [*model.named_parameters(), *_placed_buffers(model)]


def _world(grid: object) -> int | None:
    """The world size of a grid recorded as a list, or None."""
    if not isinstance(grid, list) or not all(isinstance(g, int) for g in grid):
        return None
    return int(torch.tensor(grid).prod())
