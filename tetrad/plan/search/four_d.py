"""The 4D search: every grid, micro-batch and checkpointing choice, ranked by predicted step
time (:func:`search_4d`).

4D space (tetrad / AxoNN, with context parallelism a fifth axis): every ordered factorisation
``G_data * G_context * G_z * G_y * G_x = GPUs`` whose sizes shard the model
(:func:`tetrad.spec.sharding.grid_problems`), split the sequence (``S % (2 G_context) ==
0``, :func:`tetrad.plan.comm.context_parallel.context_problems`; ``G_context = 1`` only with
``comm_model="axonn"``) and split the global batch (``B % (G_data G_z) == 0``); every
micro-batch ``b`` dividing ``B / (G_data G_z)``; activation checkpointing ``none``,
``selective`` and ``full`` (:data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`), where
``none`` does not fit ``selective`` on the fewest blocks that fit (``selective:K``,
:func:`tetrad.plan.memory.runtime.fewest_selective`). Configurations whose
:func:`tetrad.plan.memory.runtime.runtime_memory` estimate is above 80% of GPU memory are dropped
(Fujii et al., arXiv 2411.06465); memory grows with ``b``, so the micro-batch loop stops at the
first that does not fit. The survivors are ranked by :func:`tetrad.plan.step_time.estimate`
(``comm_model="tetrad"``) or by compute plus AxoNN's communication time (``comm_model="axonn"``,
:func:`tetrad.plan.comm.axonn.axonn_comm`).

The sharded optimizer (``shard_optimizer``: AdamW states over data x context, ZeRO-1) is a
dimension: under ``auto`` a grid with ``G_data G_context > 1`` also offers each (mode,
micro-batch) that fits with the states sharded, timed with
:func:`tetrad.plan.question.sharded`'s question (where both fit, either may be the faster:
the sharded all-gather after the update is exposed, but with bf16 weights it carries half
the bytes, and in a pipeline less of the tail is left to the cool-down).

The classic Megatron-style space beside it: :mod:`tetrad.plan.search.classic`; both together:
:func:`tetrad.plan.search.plan.plan`.

Each grid with ``G_x`` and ``G_y`` above 1 is tried in both orientations of the layer pairs
(:data:`tetrad.spec.grid.ORIENTATIONS`, where the roles shard the model); the rows say which
(``yx``). With one tensor axis the two orientations are the two grids that name it X or Y.

Speed, by design: memory is evaluated once per (grid, checkpointing mode) as a line in the
micro-batch (:mod:`tetrad.plan.search.memory_fits`) and rejects a configuration before anything
is timed; what fits gives each group (grid, orientation, optimizer variant) a floor of its
steps before its configurations are built, and the groups are visited best first
(:meth:`Search4D.rank`, :func:`tetrad.plan.search.top.best_first`), in one queue with the
pipeline search's entries (:class:`tetrad.plan.search.pipeline.pipe_search.PipeSearch`), so
whichever axis sets the bar prunes the other's.

A 5D group's floor (:meth:`Search4D._group_floor`,
:meth:`tetrad.plan.search.step_bounds.StepBounds.group_floor`) needs what fits (the memory
lines) and the compute per sample, not its configurations, which are built
(:meth:`tetrad.plan.search.memory_fits.MemoryFits.expand`) only when the group is visited. Each
configuration then passes through the same queue at its bounds, cheapest first
(:class:`~tetrad.plan.search.step_bounds.StepBounds`: the cheap bound, then with the X/Y and
context collectives), and is timed when its last bound comes up, unless it is not below the
slowest of the best found so far. Ties in step time go to the earlier enumerated configuration
(:mod:`tetrad.plan.search.top`), so the order of the visits changes no answer. Every cost that
depends on a shape only (a Linear's collectives, the fused rings, compute per ``(G_context,
G_y, G_x, b)``, grid validity, bandwidths per ``(stride, size)``) is memoised. The statistics
count the (grid, orientation) whose memory the search modelled (``memory_groups``) and, on
those only, the configurations enumerated (``candidates``), fitting, ``pruned`` (fitting, not
timed) and timed (``evaluated``); the groups a floor rejected before their memory count in none.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from types import SimpleNamespace

from tetrad.plan.comm.axonn import axonn_comm
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.memory.formats import residual_bytes, residual_option
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.memory.sharded_optimizer import check_shard_optimizer
from tetrad.plan.memory.states import param_bytes
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.group_floors import GroupFloors
from tetrad.plan.search.memory_fits import MemoryFits, sequence_parallel_memory
from tetrad.plan.search.pipeline.pipe_search import PipeSearch, is_pipeline
from tetrad.plan.search.rows import Row
from tetrad.plan.search.space import (
    check_inputs,
    checkpointing_modes,
    factorizations,
    nearby_gpu_counts,
)
from tetrad.plan.search.step_bounds import MARGIN, StepBounds
from tetrad.plan.search.top import PIPELINE_SEQ, best_first, offer, ranked, slowest
from tetrad.plan.step_time import estimate
from tetrad.spec.activation_checkpointing import CHECKPOINTING
from tetrad.spec.grid import COMM_AXES, GRID_AXES, ORIENTATIONS, grid_sizes, role_sizes
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import context_problems, grid_problems
from tetrad.spec.units import GiB

SHAPE, MAY_FIT, FITS, CHEAP, TIME, PIPE = 0, 1, 2, 3, 4, 5
"""Kinds of the queue's entries: the 5D groups of a tensor/context shape at their floor
(:meth:`~tetrad.plan.search.group_floors.GroupFloors.shape_floor`); a 5D group at the floor of
what may fit, of what fits; one of
its configurations at its cheap bound, at its bound with the X/Y collectives (then timed);
``PIPE`` plus a kind of the pipeline search's entries (:meth:`PipeSearch.visit`)."""


class Search4D:
    """One 4D search: the question (``ctx``), the memory limit, what it tries, the statistics, and
    the memos of its ranking.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        gpus: GPUs of every grid.
        mem_bytes: GPU memory, bytes (configurations above 80% of it are dropped).
        comm_model: ``"tetrad"`` or ``"axonn"``.
        dtype: ``"bf16"`` or ``"fp32"`` (the memory model's and the compute's bytes).
        shard_optimizer: ``"auto"``, ``"on"`` or ``"off"`` (``"off"`` with the axonn model).
        modes: the checkpointing modes tried (:func:`tetrad.plan.search.space.
            checkpointing_modes`).
        allowed: the micro-batches allowed (None: every divisor).
        params: the weights' stored format (``fp32``; ``bf16`` with fp32 masters: the memory
            model's, :mod:`tetrad.plan.memory.states`).
        residual: the residual stream's format (None: ``dtype``'s; ``fp32`` under bf16
            compute: the memory model's saved norm inputs and checkpointed block inputs,
            :mod:`tetrad.plan.memory.activations`).
        regather: where sequence parallelism runs, each pair's first Linear keeps its input's
            sequence shard (``--sequence-parallel-regather``): the memory model's
            ``sequence_parallel="regather"`` (the step time's is ``ctx``'s).
    """

    def __init__(
        self,
        ctx: StepQuestion,
        gpus: int,
        mem_bytes: float,
        comm_model: str,
        dtype: str,
        shard_optimizer: str = "auto",
        modes: tuple[str, ...] = CHECKPOINTING,
        allowed: set | None = None,
        params: str = "fp32",
        residual: str | None = None,
        regather: bool = False,
    ):
        self.ctx, self.gpus, self.mem_bytes = ctx, gpus, mem_bytes
        self.residual, self.regather = residual, regather
        check_shard_optimizer(shard_optimizer)
        self.shard_optimizer = shard_optimizer if comm_model == "tetrad" else "off"
        self.comm_model, self.dtype, self.params = comm_model, dtype, params
        self.prefetch = "prefetch" in ctx.overlaps
        self.modes, self.allowed = modes, allowed
        keys = ("grids", "valid_grids", "batch_grids", "candidates", "fitting", "pruned")
        self.stats = dict.fromkeys((*keys, "evaluated"), 0)
        self.memory_fits = MemoryFits(
            ctx,
            mem_bytes,
            dtype,
            self.prefetch,
            self.shard_optimizer,
            modes,
            allowed,
            self.stats,
            params,
            residual,
            regather,
        )
        self.valid: dict = {}  # (G_z, G_y, G_x) -> the grid shards the model
        self.turns: dict = {}  # (G_z, G_y, G_x) -> the orientations that shard the model
        self.floors = GroupFloors(ctx, allowed)

    def pipeline_search(self) -> PipeSearch:
        """The pipeline part of this search (:mod:`tetrad.plan.search.pipeline`), on its question,
        memory limit, modes and micro-batches, counting into its statistics."""
        return PipeSearch(
            self.ctx,
            self.gpus,
            mem_bytes=self.mem_bytes,
            dtype=self.dtype,
            prefetch=self.prefetch,
            shard_optimizer=self.shard_optimizer,
            modes=self.modes,
            allowed=self.allowed,
            orientations=self.orientations,
            stats=self.stats,
            params=self.params,
            residual=self.residual,
            regather=self.regather,
        )

    def groups(self) -> list[tuple]:
        """``(grid, orientation)`` of every grid that shards the model and splits the batch, in
        each orientation it is tried in, in enumeration order: the 5D groups, whose memory
        (:meth:`~tetrad.plan.search.memory_fits.MemoryFits.oriented_fits`) and configurations
        (:meth:`~tetrad.plan.search.memory_fits.MemoryFits.expand`) the ranking builds when it
        visits them."""
        model, gb, stats = self.ctx.model, self.ctx.global_batch, self.stats
        groups = []
        for grid in factorizations(self.gpus, 5):
            gd, gc, gz, gy, gx = grid
            if gc > 1 and (self.comm_model == "axonn" or context_problems(self.ctx.seq_len, gc)):
                continue  # AxoNN's model has no context axis; the sequence must split
            stats["grids"] += 1
            key = (gz, gy, gx)
            ok = self.valid.get(key)
            if ok is None:  # in an orientation it is tried in (heads split over the Y role)
                ok = any(
                    not grid_problems(model, role_sizes(grid, o)) for o in self.orientations(grid)
                )
                self.valid[key] = ok
            if not ok:
                continue
            stats["valid_grids"] += 1
            if gb % (gd * gz):
                continue
            stats["batch_grids"] += 1
            groups += [(grid, turn) for turn in self.orientations(grid)]
        return groups

    def orientations(self, grid: tuple) -> tuple[str, ...]:
        """The orientations ``grid`` is tried in: with ``G_x`` and ``G_y`` both above 1, those
        whose roles shard the model (heads split over the Y role), each ranked on its own
        (which is faster depends on the links as well as the bytes); else ``xy`` alone: with
        one tensor axis, ``yx`` is the same layout of ranks as ``xy`` on the grid with that
        axis named the other way, which the search enumerates too; and AxoNN's model has only
        ``xy``."""
        gy, gx = grid[3], grid[4]
        if self.comm_model != "tetrad" or gx == 1 or gy == 1:
            return ("xy",)
        key = (grid[2], gy, gx)
        got = self.turns.get(key)
        if got is None:
            model = self.ctx.model
            got = tuple(o for o in ORIENTATIONS if not grid_problems(model, role_sizes(grid, o)))
            self.turns[key] = got
        return got

    def check_found(self, found: bool = True) -> None:
        """Raises :class:`PlanError` saying what to change when no grid shards the model, none
        splits the batch, or nothing fits (``found`` False)."""
        model, gpus, gb = self.ctx.model, self.gpus, self.ctx.global_batch
        if self.stats["valid_grids"] == 0:
            raise PlanError(
                f"no 4D grid of {gpus} GPUs shards {model.name} (sizes must divide "
                f"hidden, heads, FFN and vocabulary): use a GPU count such as "
                f"{nearby_gpu_counts(model, gpus)}"
            )
        if self.stats["batch_grids"] == 0:
            ok = [
                g for g in factorizations(gpus, 5) if not context_problems(self.ctx.seq_len, g[1])
            ]
            least = min(g[0] * g[2] for g in ok if self.valid.get(g[2:]))
            raise PlanError(
                f"global batch {gb} does not split over G_data*G_z on any grid "
                f"of {gpus} GPUs that shards {model.name} (the smallest G_data*G_z is "
                f"{least}): use a --global-batch that is a multiple of {least}, or "
                f"--gpus {nearby_gpu_counts(model, gpus).split(',')[0]}"
            )
        if not found:
            raise PlanError(
                f"no 4D configuration of {model.name} fits under 80% of "
                f"{self.mem_bytes / GiB:.0f} GiB per GPU on {gpus} GPUs (batch "
                f"{gb} x {self.ctx.seq_len}): use more --gpus, a shorter --seq-len, "
                "a smaller model or a machine with more memory"
                + (", or --residual-dtype auto" if self.residual == "fp32" else "")
            )

    def rank(self, groups: list, top: int, pipes=None) -> list:
        """The ``top`` fastest configurations of the 5D groups (:meth:`groups`: ``(grid,
        orientation)``) and, with ``pipes`` (:meth:`pipeline_search`), of the pipeline search,
        as the heap
        of :mod:`tetrad.plan.search.top` (items ``(grid, b, ckpt, orientation, estimate)``; a
        pipeline's estimate is its ``(PipeEstimate, PipeConfig, memory, sharded)``).

        Each group's optimizer variants enter the queue at a floor from what may fit
        (:meth:`~tetrad.plan.search.memory_fits.MemoryFits.may_fit`); visited, the group's
        memory lines are built (:meth:`~tetrad.plan.search.memory_fits.MemoryFits.oriented_fits`,
        counted in the statistics) and the variant enters again at the floor of what fits;
        visited again, its configurations enter at their cheap bounds (:meth:`_visit_group`),
        then at their bounds with the X/Y collectives, and are timed when the queue reaches
        them (:meth:`_visit_config`): the first timed are those with the lowest bounds, so the
        bar is near its last value after the first ``top``. The pipeline search's entries
        (:meth:`PipeSearch.entries`, then what :meth:`PipeSearch.visit` gives) share the
        queue: a pipeline that sets the bar prunes 5D groups, and the reverse. Ties in step
        time go to the lower sequence number whatever the order of visits
        (:mod:`tetrad.plan.search.top`), the pipelines' after every 5D one's."""
        bounds = None
        if self.comm_model == "tetrad":
            plain = StepBounds(self.ctx)
            bounds = {False: plain, True: StepBounds(sharded(self.ctx), like=plain)}
        queue: list = []
        shapes: dict = {}  # the roles' (G_context, G_y, G_x) -> (shape floor, groups' indices)
        for gi, (grid, turn) in enumerate(groups):
            roles = role_sizes(grid, turn)
            got = shapes.get(key := (roles[1], roles[3], roles[4]))
            if got is None:
                got = shapes[key] = (self.floors.shape_floor(roles), [])
            got[1].append(gi)
        for floor, members in shapes.values():
            queue.append((floor, SHAPE, len(queue), members))
        if pipes is not None:
            pipes.seq = PIPELINE_SEQ
            for bound, kind, shape in pipes.entries():
                queue.append((bound, PIPE + kind, len(queue), shape))
        heapq.heapify(queue)
        numbers = itertools.count(len(queue))

        def push(bound: float, kind: int, payload: tuple) -> None:
            heapq.heappush(queue, (bound, kind, next(numbers), payload))

        # fits: group -> its RoleFits; floors: (roles, variant, kind) -> group floor (both
        # follow the roles)
        run = SimpleNamespace(groups=groups, bounds=bounds, best=[], top=top, pipes=pipes)
        run.push, run.fits, run.floors = push, {}, {}
        best_first(queue, run.best, top, functools.partial(self._visit, run), MARGIN)
        self.stats["memory_groups"] = len(run.fits)
        best = run.best
        self.stats["pruned"] = self.stats["fitting"] - self.stats["evaluated"]
        return best

    def _visit(self, run: SimpleNamespace, kind: int, payload) -> None:
        """Visit an entry of :meth:`rank`'s queue (``run``: its groups, bounds, best, top,
        pipeline search, push, and memos): a pipeline entry (:meth:`PipeSearch.visit`), a
        configuration (:meth:`_visit_config`), a shape (its groups at the floor of what may
        fit), a group at that floor (its memory lines; the floor of what fits) or at that
        (:meth:`_visit_group`)."""
        best, top, bounds, push = run.best, run.top, run.bounds, run.push
        if kind >= PIPE:
            for bound, sub, more in run.pipes.visit(kind - PIPE, payload, best, top):
                push(bound, PIPE + sub, more)
            return
        if kind >= CHEAP:
            self._visit_config(best, top, bounds, push, kind, payload)
            return
        if kind == SHAPE:
            for gi in payload:
                for zero, classes in self.memory_fits.may_fit(role_sizes(*run.groups[gi])).items():
                    push(self._floor_of(run, MAY_FIT, gi, zero, classes), MAY_FIT, (gi, zero))
            return
        gi, zero = payload
        grid, turn = run.groups[gi]
        got = run.fits.get(gi)
        if got is None:
            got = run.fits[gi] = self.memory_fits.oriented_fits(grid, turn)
        if kind == FITS:
            self._visit_group(best, top, bounds, push, gi, grid, turn, got, zero)
        elif zero in got.variants():
            push(self._floor_of(run, FITS, gi, zero, got.classes(zero)), FITS, payload)

    def _floor_of(self, run: SimpleNamespace, kind: int, gi: int, zero: bool, classes) -> float:
        """:meth:`_group_floor` of group ``gi`` in variant ``zero`` (``kind``: from what may
        fit or what fits), memoised per roles in ``run.floors``."""
        grid, turn = run.groups[gi]
        key = (role_sizes(grid, turn), zero, kind)
        got = run.floors.get(key)
        if got is None:
            got = run.floors[key] = self._group_floor(run.bounds, grid, turn, zero, classes)
        return got

    def _visit_group(self, best: list, top: int, bounds, push, gi: int, grid, turn, fits, zero):
        """Queue the configurations of group ``gi`` (``grid`` in orientation ``turn``, what
        fits ``fits``) in variant ``zero`` that may enter ``best``, at their cheap bound (at
        their compute with the axonn model, ``bounds`` None)."""
        keep, limit = 1.0 - MARGIN, slowest(best, top)
        # enumeration order; expand's index < 2^20: at most 3 modes times the divisors of B
        base = (gi << 21) | (int(zero) << 20)
        for lb, index, b, ckpt in self.memory_fits.expand(role_sizes(grid, turn), fits, zero):
            if lb * keep >= limit:
                break  # sorted: no later one's compute alone is below it
            config = (grid, b, ckpt, turn, zero, base | index)
            if bounds is None:
                push(lb, TIME, config)
                continue
            floor = bounds[zero].cheap(grid, b, ckpt, lb, turn)
            if floor * keep < limit:
                push(floor, CHEAP, (floor, config))

    def _visit_config(self, best: list, top: int, bounds, push, kind: int, payload) -> None:
        """A configuration's next stage: from its cheap bound to its bound with the X/Y and
        context collectives (:meth:`~tetrad.plan.search.step_bounds.StepBounds.with_xy`),
        queued where it may enter ``best``; from that to its estimate, timed into ``best``."""
        if kind == CHEAP:
            floor, config = payload
            grid, b, ckpt, turn, zero, _ = config
            bound = bounds[zero].with_xy(floor, grid, b, ckpt, turn)
            if bound * (1.0 - MARGIN) < slowest(best, top):
                push(bound, TIME, config)
            return
        grid, b, ckpt, turn, zero, seq = payload
        self.stats["evaluated"] += 1
        step, est = self._time(grid, b, ckpt, turn, zero)
        offer(best, top, step, seq, (grid, b, ckpt, turn, est))

    def _group_floor(self, bounds, grid, turn: str, zero: bool, classes: dict) -> float:
        """:meth:`~tetrad.plan.search.group_floors.GroupFloors.group_floor`, seconds."""
        return self.floors.group_floor(bounds, grid, turn, zero, classes)

    def _time(self, grid, b: int, ckpt: str, turn: str, zero: bool) -> tuple[float, object]:
        """Step seconds and what the row needs: an :class:`~tetrad.plan.step_time.Estimate`
        (tetrad; ``zero``: with the sharded optimizer), or AxoNN's ``(comm per axis, compute,
        recompute, micro-batches)`` (axonn)."""
        ctx = self.ctx
        if self.comm_model == "tetrad":
            est = estimate(sharded(ctx) if zero else ctx, grid, b, ckpt, orientation=turn)
            return est.step_s, est
        acc = ctx.global_batch // (grid[0] * grid[2] * b)
        comp = ctx.compute(grid, b).over_step(acc, grid_sizes(grid)[1])
        fwd, bwd, rec = comp.micro_batch_seconds(ctx.model.n_layers, ckpt)
        ax = axonn_comm(
            ctx.model, ctx.machine, grid_sizes(grid), ctx.global_batch, ctx.seq_len, acc
        )
        step = acc * (fwd + bwd + rec) + ax["total"]
        return step, (ax, acc * (fwd + bwd + rec), acc * rec, acc)

    def row(self, step: float, grid, b: int, ckpt: str, turn: str, est) -> Row:
        """The :class:`Row` of one ranked configuration (with its memory estimate)."""
        ctx = self.ctx
        zero = getattr(est, "shard_optimizer", False)
        roles = role_sizes(grid, turn)
        sp = sequence_parallel_memory(
            self.comm_model == "tetrad" and ctx.sequence_split(roles[1], roles[3], roles[4]) > 1,
            self.regather,
        )
        mem = runtime_memory(
            ctx.model,
            roles,
            b,
            ctx.seq_len,
            self.mem_bytes,
            activation_checkpointing=ckpt,
            dtype=self.dtype,
            prefetch=self.prefetch,
            shard_optimizer=zero,
            params=self.params,
            **({"sequence_parallel": sp} if sp else {}),
            **({"residual": self.residual} if self.residual is not None else {}),
        )
        if self.comm_model == "tetrad":
            compute_s, rec_s, exposed, comm_s = (
                est.compute_s,
                est.recompute_s,
                est.exposed_s,
                est.comm_s,
            )
            acc, step = est.grad_accum, est.step_s
        else:
            ax, compute_s, rec_s, acc = est
            exposed = {a: ax.get(a, 0.0) for a in COMM_AXES}
            comm_s = dict(exposed)
        return Row(
            "4d",
            dict(zip(GRID_AXES, grid, strict=True)),
            b,
            acc,
            ckpt,
            step,
            compute_s,
            rec_s,
            exposed,
            comm_s,
            0.0,
            0.0,
            mem,
            self.comm_model,
            orientation=turn,
            shard_optimizer=zero,
            sequence_parallel=bool(sp),
        ).finish(ctx.model, ctx.machine, self.gpus, ctx.global_batch, ctx.seq_len)


def search_4d(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[str | bool, ...] = CHECKPOINTING,
    micro_batches: tuple[int, ...] | None = None,
    overlaps="all",
    comm_model: str = "tetrad",
    dtype: str = "bf16",
    gpu_memory_bytes: float | None = None,
    pipeline: bool = True,
    shard_optimizer: str = "auto",
    fp8: str = "off",
    params: str = "fp32",
    sequence_parallel: bool | str = False,
    residual: str | None = None,
    regather: bool = False,
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting 4D configurations (by step seconds) and search statistics;
    with ``pipeline`` (and the tetrad comm model) pipeline grids too
    (:mod:`tetrad.plan.search.pipeline`).

    Args:
        checkpointing: activation-checkpointing modes to try (``none``, ``selective``,
            ``full``; bools mean ``full``/``none``).
        micro_batches: allowed micro-batch sizes (default: every divisor).
        overlaps: the runtime's overlaps assumed on (``"all"``, ``"none"`` or names).
        comm_model: ``"tetrad"`` (runtime-exact, alpha-beta, overlap) or ``"axonn"``.
        gpu_memory_bytes: override of the machine's memory, bytes.
        shard_optimizer: the runtime's sharded optimizer (AdamW states over data x context):
            ``off``, ``on`` (wherever ``G_data G_context > 1``) or ``auto`` (both where
            ``G_data G_context > 1``, each where it fits, ranked by step time: module doc).
        fp8: the FP8 recipe of the step model (:mod:`tetrad.plan.compute.fp8`; ``off``, the
            default, leaves every estimate as without it); memory as without FP8.
        params: the weights' stored format (``tetrad train --param-dtype``): ``fp32``, or
            ``bf16`` with fp32 masters among the optimizer states (the memory model's; in the
            step's time, the sharded optimizer's all-gathers after the update carry bf16).
        residual: the residual stream's format (``tetrad train --residual-dtype``): ``auto``
            or None (the compute dtype's, the default), ``fp32`` or ``bf16``: the memory
            model's (each norm's saved input and normalised tensor, a checkpointed block's
            input); in the step's time only the embedding's sum over Y carries it.
        sequence_parallel: the runtime's ``--sequence-parallel`` on the grids where it runs
            (``G_y > 1``, a dense model:
            :meth:`tetrad.plan.question.StepQuestion.sequence_split`), time and memory:
            ``off`` (or False, the default: every estimate as without it), ``on`` (or True) or
            ``auto`` (both searched, their rows merged: a grid is ranked with it where that is
            faster; its collectives are blocking where Domino and ``fine`` hide the
            all-reduce's, so it can be slower where the memory it saves is not needed).
        regather: with ``sequence_parallel`` (``on``, or ``auto``'s search with it), each
            pair's first Linear keeps its input's sequence shard and all-gathers it again in
            backward (``tetrad train --sequence-parallel-regather``): the memory model's and
            the step model's ``sequence_parallel="regather"`` (fewer saved bytes, one more
            all-gather over Y per pair and micro-batch); ignored where it is off.

    Raises:
        PlanError: no grid shards the model, no grid splits the batch, or nothing fits; the
            message says what to change; FP8 on a machine without it.
    """
    sp = {False: "off", True: "on"}.get(sequence_parallel, sequence_parallel)
    if sp not in ("off", "on", "auto"):
        raise PlanError(f"sequence_parallel {sequence_parallel!r}: use off, on or auto")
    if sp == "auto":
        t0 = time.perf_counter()
        opts = dict(
            top=top,
            checkpointing=checkpointing,
            micro_batches=micro_batches,
            overlaps=overlaps,
            comm_model=comm_model,
            dtype=dtype,
            gpu_memory_bytes=gpu_memory_bytes,
            pipeline=pipeline,
            shard_optimizer=shard_optimizer,
            fp8=fp8,
            params=params,
            residual=residual,
            regather=regather,
        )
        args = (model, machine, gpus, global_batch, seq_len)
        rows, _ = search_4d(*args, **opts, sequence_parallel="off")
        more, stats = search_4d(*args, **opts, sequence_parallel="on")
        seen = {(r.label(), r.micro_batch, r.activation_checkpointing) for r in rows}
        rows += [
            r for r in more if (r.label(), r.micro_batch, r.activation_checkpointing) not in seen
        ]
        rows.sort(key=lambda r: r.step_s)  # stable: the off search's row first on a tie
        stats["seconds"] = time.perf_counter() - t0
        return rows[:top], stats
    check_inputs(model, gpus, global_batch, seq_len)
    if comm_model not in ("tetrad", "axonn"):
        raise PlanError(f"comm model {comm_model!r} is unknown: use tetrad or axonn")
    t0 = time.perf_counter()
    mem_bytes = float(gpu_memory_bytes or machine.memory_bytes)
    residual = residual_option(dtype, residual)
    ctx = StepQuestion(
        model,
        machine,
        seq_len,
        global_batch,
        overlaps=overlaps,
        compute_bytes=2 if dtype == "bf16" else 4,
        param_bytes=param_bytes(params),
        residual_bytes=residual_bytes(dtype, residual),
        fp8=fp8,
        sequence_parallel=sequence_parallel_memory(sp == "on" and comm_model == "tetrad", regather),
    )
    modes = checkpointing_modes(checkpointing)
    allowed = set(micro_batches) if micro_batches else None
    more = (shard_optimizer, modes, allowed, params, residual, regather)
    search = Search4D(ctx, gpus, mem_bytes, comm_model, dtype, *more)
    groups = search.groups()
    pipes = None
    if pipeline and comm_model == "tetrad":
        pipes = search.pipeline_search()
    if pipes is None or not search.stats["valid_grids"]:
        search.check_found()  # a pipeline's stages may split a batch no 5D grid does
    best = search.rank(groups, top, pipes)
    if not best:
        search.check_found(found=False)
    rows = [
        pipes.row(step, grid, b, ckpt, turn, est)
        if is_pipeline(est)
        else search.row(step, grid, b, ckpt, turn, est)
        for step, (grid, b, ckpt, turn, est) in ranked(best)
    ]
    search.stats["seconds"] = time.perf_counter() - t0
    return rows, search.stats
