"""The pipeline search (:class:`PipeSearch`): the entries of the package doc's space visited best
first against the 5D search's top-K, each group, grid and schedule pruned by the bounds and
memory floors of :mod:`~tetrad.plan.search.pipeline.group_bounds`,
:mod:`~tetrad.plan.search.pipeline.memory_floors` and
:mod:`~tetrad.plan.search.pipeline.schedule_floors` (package doc,
:mod:`tetrad.plan.search.pipeline`), what is left checked against its memory rank by rank and
timed (:func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from tetrad.plan.memory.breakdown import FIT_FRACTION
from tetrad.plan.memory.pipeline import pipeline_memory, stage_memory
from tetrad.plan.pipe.pipeline_step import PipeConfig, PipeEstimate, pipeline_estimate, split_ranks
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.memory_fits import optimizer_variants, sequence_parallel_memory
from tetrad.plan.search.pipeline.configs import MODE_ORDER, enumeration_order, schedules
from tetrad.plan.search.pipeline.floor_terms import FloorTerms
from tetrad.plan.search.pipeline.group_bounds import GroupBounds
from tetrad.plan.search.pipeline.memory_floors import MemoryFloors
from tetrad.plan.search.pipeline.schedule_floors import ScheduleFloors
from tetrad.plan.search.rows import Row
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.plan.search.top import best_first, offer, slowest
from tetrad.spec.grid import GRID_AXES, role_sizes
from tetrad.spec.sharding import grid_problems

SHAPE, GROUP, GRID, SCHEDULE, RANKED = 1, 2, 3, 4, 5
"""Kinds of the search's entries (:meth:`PipeSearch.visit`): a tensor/context shape, a group,
a grid in an orientation, a schedule at bound 3, a schedule at its rank floor."""


class PipeSearch:
    """The pipeline part of one 4D search.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`), the 5D search's.
        gpus: GPUs of every pipeline grid.
        mem_bytes: GPU memory, bytes (a rank above 80% of it does not fit).
        dtype: ``"bf16"`` or ``"fp32"`` (the memory model's compute dtype).
        prefetch: the ``prefetch`` overlap is on (the memory model's gathered weights).
        shard_optimizer: ``"off"``, ``"on"`` or ``"auto"``
            (:func:`~tetrad.plan.search.memory_fits.optimizer_variants`).
        modes: the checkpointing modes tried (kept in
            :data:`~tetrad.plan.search.pipeline.configs.MODE_ORDER`).
        allowed: the micro-batches allowed (None: every divisor).
        orientations: ``--grid -> orientations`` the 5D search tries it in
            (:meth:`tetrad.plan.search.four_d.Search4D.orientations`).
        stats: the statistics to count into (``pipe_groups``, ``pipe_candidates``,
            ``pipe_fitting``, ``pipe_evaluated``; a new dict when None).
        params: the weights' stored format (``fp32``; ``bf16`` with fp32 masters).
        residual: the residual stream's format (``--residual-dtype``; None: ``dtype``'s).
        regather: with sequence parallelism, the first Linears' inputs kept split
            (``--sequence-parallel-regather``): the memory model's ``"regather"``.
    """

    def __init__(
        self,
        ctx: StepQuestion,
        gpus: int,
        *,
        mem_bytes: float,
        dtype: str = "bf16",
        prefetch: bool = True,
        shard_optimizer: str = "auto",
        modes: tuple[str, ...] = MODE_ORDER,
        allowed: set | None = None,
        orientations: Callable[[tuple], tuple[str, ...]],
        stats: dict | None = None,
        params: str = "fp32",
        residual: str | None = None,
        regather: bool = False,
    ):
        self.ctx, self.gpus, self.mem_bytes = ctx, gpus, mem_bytes
        self.dtype, self.prefetch, self.shard_optimizer = dtype, prefetch, shard_optimizer
        self.params, self.residual, self.regather = params, residual, regather
        self.modes = tuple(m for m in MODE_ORDER if m in modes)
        self.allowed, self.orientations = allowed, orientations
        self.terms = FloorTerms(ctx, gpus)
        limit = FIT_FRACTION * mem_bytes
        self.memory_floors = MemoryFloors(
            ctx, limit, dtype, shard_optimizer, self.terms, params, residual, regather
        )
        self.group_bounds = GroupBounds(
            ctx, gpus, self.modes, allowed, self.terms, self.memory_floors, self._turns
        )
        self.schedule_floors = ScheduleFloors(ctx, self.terms)
        self.fit_memo: dict = {}  # (roles, b, mode, cfg, sharded) -> worst rank's memory or None
        self.turn_memo: dict = {}  # roles -> ((--grid, orientation), ...)
        self.over_memo: dict = {}  # schedule -> the rank last found above the memory limit
        self.seq = 0  # where extend numbers the configurations from
        self.stats = {} if stats is None else stats
        for k in ("pipe_groups", "pipe_candidates", "pipe_fitting", "pipe_evaluated"):
            self.stats.setdefault(k, 0)

    def extend(self, best: list, top: int, seq0: int) -> None:
        """Push the pipeline configurations that enter the top-K into ``best`` (the heap of
        :mod:`tetrad.plan.search.top`), numbered from ``seq0`` in enumeration order
        (:func:`~tetrad.plan.search.pipeline.configs.enumeration_order`): :meth:`entries` visited
        best first (:func:`tetrad.plan.search.top.best_first`)."""
        self.seq = seq0
        numbers = itertools.count()
        queue = [(bound, kind, next(numbers), shape) for bound, kind, shape in self.entries()]
        heapq.heapify(queue)

        def visit(kind: int, payload) -> None:
            for entry in self.visit(kind, payload, best, top):
                heapq.heappush(queue, (*entry[:2], next(numbers), entry[2]))

        best_first(queue, best, top, visit, MARGIN)

    def entries(self) -> list[tuple[float, int, tuple]]:
        """``(bound 1, SHAPE, shape)`` of every tensor/context shape (:meth:`GroupBounds.shapes`):
        where the search starts. None for a mixture-of-experts model: the split and the floors take
        every block alike (and ``tetrad plan`` and ``--grid auto`` refuse such models)."""
        if self.ctx.model.is_moe:
            return []
        return [(shape[0], SHAPE, shape) for shape in self.group_bounds.shapes()]

    def visit(self, kind: int, payload: tuple, best: list, top: int) -> list[tuple]:
        """Visit an entry; gives ``(bound, kind, payload)`` of the finer entries that may enter
        ``best``, each bound at least its parent's: a shape (:data:`SHAPE`) its groups
        (:meth:`_shape`), a group (:data:`GROUP`) its grids (:meth:`_group`), a grid
        (:data:`GRID`) its schedules at bound 3 (:meth:`_grid`), a schedule
        (:data:`SCHEDULE`) itself at its rank floor (:meth:`_schedule`); a schedule at that
        (:data:`RANKED`) is timed into ``best`` (:meth:`_time`). Visited best first (in one
        queue with the 5D search's entries, :meth:`tetrad.plan.search.four_d.Search4D.rank`),
        the first configurations timed are those of the lowest floors."""
        if kind == RANKED:
            self._time(best, top, *payload[1])
            return []
        limit = slowest(best, top)
        if kind == SHAPE:
            return self._shape(payload, limit)
        if kind == GROUP:
            return self._group(payload, limit)
        return self._grid(payload, limit) if kind == GRID else self._schedule(payload, limit)

    def _shape(self, shape: tuple, limit: float) -> list[tuple]:
        """The groups of a shape (:meth:`GroupBounds.groups`) at bound 2, at least the shape's
        bound 1 with its context collectives (a floor of every group of the shape). Where bound
        2 does not grow with the micro-batch (:meth:`GroupBounds.monotone`), per ``G_pipe``
        only the largest micro-batch's group, with the smaller ones to follow it
        (:meth:`_group`): a chain in descending ``b``, each group's bound the next's floor."""
        _, gc, gy, gx, mode, per_sample, lb_kv = shape
        self.stats["pipe_groups"] += 1
        keep, out, bounds = 1 - MARGIN, [], self.group_bounds
        if lb_kv * keep >= limit:
            return out  # no group of this shape can enter (their context collectives)
        for pipe in bounds.pipes:
            if not bounds.monotone():
                for group in bounds.groups(pipe, gc, gy, gx, mode, per_sample, limit):
                    out.append((max(group[0], lb_kv), GROUP, (group, (), lb_kv, None)))
                continue
            q, sizes = bounds.micro_batches(pipe, gc, gy, gx, per_sample, limit)
            if sizes:
                group = bounds.group(pipe, q, gc, gy, gx, sizes[-1], mode)
                out.append((max(group[0], lb_kv), GROUP, (group, sizes[-2::-1], lb_kv, None)))
        return out

    def _group(self, payload: tuple, limit: float) -> list[tuple]:
        """First visit: the next group of the chain (:meth:`_shape`), and the group again at
        its bound with the context and known X/Y collectives (:meth:`GroupBounds.refined`)
        unless that cannot enter; second: the group's grids whose memory floor fits at their
        bounds (:meth:`GroupBounds.grids`; with no bar yet, every such grid at its bound)."""
        (lb, pipe, q, gc, gy, gx, b, mode), smaller, floor, terms = payload
        out, lb, bounds = [], max(lb, floor), self.group_bounds
        if terms is None:
            if smaller:
                group = bounds.group(pipe, q, gc, gy, gx, smaller[0], mode)
                out.append((max(group[0], floor), GROUP, (group, smaller[1:], floor, None)))
            refined, terms = bounds.refined(pipe, q, gc, gy, gx, b, mode)
            if refined * (1 - MARGIN) < limit:
                refined = max(lb, refined)
                out.append((refined, GROUP, (payload[0], (), refined, terms)))
            return out
        for bound, grid, turn in bounds.grids(
            pipe, q, gc, gy, gx, b, mode, min(limit, 1e300), terms
        ):
            bound = max(lb, bound)
            out.append((bound, GRID, (bound, (pipe, grid, turn, b, mode))))
        return out

    def _grid(self, payload: tuple, limit: float) -> list[tuple]:
        """The schedules of a grid in an orientation at bound 3
        (:meth:`ScheduleFloors.config_floor`), those below ``limit`` (less MARGIN)."""
        lb, (pipe, grid, turn, b, mode) = payload
        m = self.ctx.global_batch // (grid[0] * grid[2] * b)
        keep, out = 1 - MARGIN, []
        for cfg in schedules(pipe, m, self.ctx.model.n_layers):
            self.stats["pipe_candidates"] += 1
            floor = self.schedule_floors.config_floor(grid, turn, b, mode, cfg, m)
            if floor * keep < limit:
                floor = max(lb, floor)
                out.append((floor, SCHEDULE, (floor, (grid, turn, b, mode, cfg, m))))
        return out

    def _schedule(self, payload: tuple, limit: float) -> list[tuple]:
        """The schedule at its rank floor (:meth:`ScheduleFloors.rank_floor`) unless its memory
        floor fails (:meth:`MemoryFloors.schedule_fails`) or that is not below ``limit``."""
        lb, config = payload
        grid, turn, b, mode, cfg, m = config
        if self.memory_floors.schedule_fails(grid, turn, b, mode, cfg):
            return []
        floor = self.schedule_floors.rank_floor(grid, turn, b, mode, cfg, m)
        if floor * (1 - MARGIN) >= limit:
            return []
        floor = max(lb, floor)
        return [(floor, RANKED, (floor, config))]

    def _turns(self, roles: tuple) -> tuple:
        """``(--grid, orientation)`` of the roles ``roles``: the grid itself in ``xy``, and
        with ``G_y``, ``G_x`` both above 1 the grid that names them the other way in ``yx``."""
        got = self.turn_memo.get(roles)
        if got is None:
            gd, gc, gz, gy, gx = roles
            out = []
            if not grid_problems(self.ctx.model, roles):
                out.append((roles, "xy"))
            if gy > 1 and gx > 1:
                phys = (gd, gc, gz, gx, gy)
                if "yx" in self.orientations(phys):
                    out.append((phys, "yx"))
            got = self.turn_memo[roles] = tuple(out)
        return got

    def _time(self, best, top, grid, turn, b, mode, cfg, m: int) -> None:
        """Time the schedule ``cfg`` of ``grid`` in orientation ``turn`` into ``best`` in each
        optimizer variant where it fits (:meth:`_fitting`), unless its rank floor plus a rank's
        tail cannot enter: ``rho``'s in every variant it may be timed in, then every rank's in
        the variant timed (:meth:`ScheduleFloors.tail_pruned`)."""
        floors = self.schedule_floors
        if len(best) >= top:
            roles = role_sizes(grid, turn)
            limit = -best[0][0]
            if all(
                floors.tail_pruned(
                    sharded(self.ctx) if zero else self.ctx,
                    grid,
                    turn,
                    b,
                    mode,
                    cfg,
                    m,
                    limit,
                    every=False,
                )
                for zero in optimizer_variants(self.shard_optimizer, roles[0] * roles[1])
            ):
                return
        for mem, zero in self._fitting(grid, turn, b, mode, cfg):
            self.stats["pipe_fitting"] += 1
            ctx = sharded(self.ctx) if zero else self.ctx
            if len(best) >= top and floors.tail_pruned(
                ctx, grid, turn, b, mode, cfg, m, -best[0][0]
            ):
                continue
            self.stats["pipe_evaluated"] += 1
            est = pipeline_estimate(ctx, cfg, grid, b, mode, turn)
            item = (grid, b, mode, turn, (est, cfg, mem, zero))
            seq = self.seq + enumeration_order(grid, turn, b, mode, cfg, zero)
            offer(best, top, est.step_s, seq, item)

    def memory(self, grid, turn: str, b: int, mode: str, cfg: PipeConfig, zero: bool = False):
        """The worst rank's :class:`~tetrad.plan.memory.breakdown.MemoryBreakdown` and every
        rank's (:func:`tetrad.plan.memory.pipeline.pipeline_memory`; ``zero``: with the
        sharded optimizer)."""
        args, opts = self._memory_args(grid, turn, b, mode, cfg, zero)
        return pipeline_memory(*args[:-1], cfg.virtual, args[-1], **opts)

    def _memory_args(self, grid, turn, b, mode, cfg: PipeConfig, zero: bool) -> tuple:
        """``(model, roles, b, S, GPU bytes, ranks, schedule, m)`` and the options of
        :func:`~tetrad.plan.memory.pipeline.pipeline_memory` (``virtual`` left out)."""
        ctx = self.ctx
        roles = role_sizes(grid, turn)
        ranks = split_ranks(
            ctx.model.n_layers, split_costs(ctx.compute(roles, b), mode), cfg.pipe, cfg.virtual
        )
        m = ctx.global_batch // (grid[0] * grid[2] * b)
        args = (ctx.model, roles, b, ctx.seq_len, self.mem_bytes, ranks, cfg.schedule, m)
        opts = {
            "activation_checkpointing": mode,
            "dtype": self.dtype,
            "prefetch": self.prefetch,
            "shard_optimizer": zero,
        }
        if self.params != "fp32":  # the memo keys of the callers that never give it
            opts["params"] = self.params
        split = ctx.sequence_split(roles[1], roles[3], roles[4])
        if split > 1:  # True, or "regather"
            opts["sequence_parallel"] = sequence_parallel_memory(True, self.regather)
        if self.residual is not None:
            opts["residual"] = self.residual
        return args, opts

    def _fits(self, grid, turn, b, mode, cfg, zero: bool = False):
        """The worst rank's memory (as :meth:`memory`'s) where every rank's is within 80% of
        the GPU's, else None: the ranks in order, the first above the limit ends it (memoised
        per roles: the two orientations of a grid hold the same)."""
        key = (role_sizes(grid, turn), b, mode, cfg, zero)
        got = self.fit_memo.get(key, 0)
        if got == 0 and self.memory_floors.schedule_fails(grid, turn, b, mode, cfg):
            got = self.fit_memo[key] = None
        if got == 0:
            got = self.fit_memo[key] = self._worst_within(grid, turn, b, mode, cfg, zero)
        return got

    def _worst_within(self, grid, turn, b, mode, cfg, zero: bool):
        """:meth:`_fits`, computed: :func:`~tetrad.plan.memory.pipeline.stage_memory` rank by
        rank, first the one that was above the limit last time on this schedule (the worst:
        the first of the largest total in rank order, as ``pipeline_memory``'s)."""
        (model, roles, b, seq, gpu, ranks, schedule, m), opts = self._memory_args(
            grid, turn, b, mode, cfg, zero
        )
        limit, mems = FIT_FRACTION * self.mem_bytes, [None] * len(ranks)
        for i in (self.over_memo.get(cfg, 0), *range(len(ranks))):
            if mems[i] is None:
                mems[i] = stage_memory(
                    model, roles, b, seq, gpu, ranks[i], schedule, len(ranks), m, **opts
                )
                if not mems[i].total <= limit:
                    self.over_memo[cfg] = i
                    return None
        return max(mems, key=lambda mb: mb.total)

    def _fitting(self, grid, turn, b, mode, cfg) -> list[tuple]:
        """``[(memory, sharded)]`` of the configuration in each optimizer variant the search
        tries (:func:`tetrad.plan.search.memory_fits.optimizer_variants`) where it fits and no
        cheaper mode fits in the same variant (under ``auto`` both variants where both fit:
        either may be the faster)."""
        out = []
        roles = role_sizes(grid, turn)
        for zero in optimizer_variants(self.shard_optimizer, roles[0] * roles[1]):
            if any(
                cheaper in self.modes and self._fits(grid, turn, b, cheaper, cfg, zero) is not None
                for cheaper in MODE_ORDER[: MODE_ORDER.index(mode)]
            ):
                continue
            mem = self._fits(grid, turn, b, mode, cfg, zero)
            if mem is not None:
                out.append((mem, zero))
        return out

    def row(self, step: float, grid, b: int, mode: str, turn: str, item) -> Row:
        """The :class:`~tetrad.plan.search.rows.Row` of a ranked pipeline configuration (``item``:
        its ``(PipeEstimate, PipeConfig, memory, sharded)``), with every rank's memory."""
        est, cfg, _, zero = item
        ctx = self.ctx
        worst, per_rank = self.memory(grid, turn, b, mode, cfg, zero)
        opts = self._memory_args(grid, turn, b, mode, cfg, zero)[1]
        return Row(
            "4d",
            dict(zip(GRID_AXES, grid, strict=True)),
            b,
            est.grad_accum,
            mode,
            est.step_s,
            est.compute_s,
            est.recompute_s,
            dict(est.exposed_s),
            dict(est.comm_s),
            0.0,
            0.0,
            worst,
            "tetrad",
            {"pipeline_bubble": est.bubble_s},
            orientation=turn,
            pipe=cfg.pipe,
            virtual_stages=cfg.virtual,
            schedule=cfg.schedule,
            stage_memory=per_rank,
            shard_optimizer=zero,
            sequence_parallel="sequence_parallel" in opts,
        ).finish(ctx.model, ctx.machine, self.gpus, ctx.global_batch, ctx.seq_len)


def is_pipeline(est) -> bool:
    """Whether a ranked item's estimate is a pipeline's ``(PipeEstimate, PipeConfig, memory,
    sharded)``."""
    return isinstance(est, tuple) and isinstance(est[0], PipeEstimate)
