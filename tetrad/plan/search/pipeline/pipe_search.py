"""The pipeline axis of the 4D search: ``G_pipe x`` virtual stages ``x`` schedule on top of every
5D grid of ``GPUs / G_pipe`` ranks (:class:`PipeSearch`), added to the 5D search's top-K.

Space: ``G_pipe`` a divisor of the GPUs from 2 to the blocks; the 5D grid of the rest as in
:mod:`tetrad.plan.search.four_d` (model sharding, context split, ``B % (G_data G_z) == 0``, both
orientations); micro-batch ``b`` dividing ``B / (G_data G_z)``, ``m`` micro-batches; checkpointing
``none``, ``selective`` or ``full`` on every block (``selective`` only where ``none`` does not
fit, ``full`` only where neither does); schedules (:mod:`tetrad.plan.pipe.schedule`): ``1f1b``
where ``m >= G_pipe`` (GPipe has the same bubble and more memory, so it is tried only where 1F1B
cannot run) and ``interleaved-1f1b`` with ``v`` in :data:`VIRTUAL_CHOICES` (``G_pipe v <= L``,
``m % G_pipe == 0``). Memory: :func:`tetrad.plan.memory.pipeline.pipeline_memory` (worst rank,
80%); time: :func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate`.

Pruning, exact (no configuration that could enter the top-K is skipped):

1. per ``(G_context, G_y, G_x, mode)``: a rank does ``1/G_pipe`` of the model's blocks on
   ``B / (G_data G_z)`` samples, ``B G_context G_y G_x / GPUs`` samples' worth of whole-model
   work whatever ``G_pipe`` is; with every GEMM at the machine's best efficiency (attention and
   element-wise work are linear in the tokens) this is a lower bound of the step;
2. per group ``(G_pipe, G_context, G_y, G_x, b, mode)``: ``m`` times the slowest rank's time
   of one micro-batch (it runs them one after another whatever the schedule), that time at
   least the average (the whole model's over ``G_pipe``) and at least ``ceil(L / G_pipe)``
   blocks'; plus, for the average, the ranks' mean idle time before their first and after their
   last operation, and for the rank of the most blocks, the stages before it that micro-batch 0
   and the last one pass through on the way in and out (the least over the group's schedules;
   where only GPipe runs, ``sum_r T_r + (m - 1) max_r T_r``), visited in ascending order of
   ``m`` times the larger floor; then, cheapest first, with the blocks' context collectives (the
   least over ``G_z``), the group's memory floor, and the blocks' exposed X/Y collectives (the
   lesser orientation) added (:mod:`tetrad.plan.search.pipeline.group_bounds`,
   :mod:`tetrad.plan.search.pipeline.memory_floors`);
3. per grid: its memory floor; then ``m`` times a rank of ``ceil(L / G_pipe)`` blocks, their
   compute, X/Y and context collectives and the Z seconds its windows cannot hide (as
   :class:`tetrad.plan.search.step_bounds.StepBounds`) and the fewest point-to-point receives of a
   rank, plus the way in and out of the split's last rank of the most blocks
   (:mod:`tetrad.plan.search.pipeline.schedule_floors`); then the schedule's memory floor; then ``m`` times
   that rank's time (shared with the estimate) plus the same way in and out; its memory (rank
   by rank, the first above the limit ends it); that floor plus a rank's tail (the optimizer
   and what the cool-down leaves exposed, :func:`tetrad.plan.pipe.pipeline_step.rank_tail`), that
   rank's first, then each's (the step adds the largest); then the estimate. Every floor of
   the path is at most the critical path of :func:`tetrad.plan.pipe.critical_path.schedule_step`
   (whose module doc gives the paths).

Groups are visited in ascending order of bound 1 and stop at the first whose bound is not below
the slowest of the top-K so far; memory floors reject whatever the top-K.
"""

from __future__ import annotations

import heapq
import itertools

from tetrad.plan.memory.breakdown import FIT_FRACTION
from tetrad.plan.memory.pipeline import pipeline_memory, stage_memory
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.pipe.pipeline_step import PipeConfig, PipeEstimate, pipeline_estimate, split_ranks
from tetrad.plan.pipe.schedule import SCHEDULES, schedule_problems
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import sharded
from tetrad.plan.search.pipeline.group_bounds import VIRTUAL_CHOICES, GroupBounds
from tetrad.plan.search.pipeline.memory_floors import MemoryFloors
from tetrad.plan.search.pipeline.schedule_floors import BlockFloors
from tetrad.plan.search.rows import Row
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.plan.search.top import best_first, offer, slowest
from tetrad.spec import GRID_AXES, ORIENTATIONS, role_sizes

MODE_ORDER = ("none", "selective", "full")
SHAPE, GROUP = 1, 2
"""Kinds of the search's entries (:meth:`PipeSearch.visit`): a tensor/context shape, a group."""
__all__ = ["VIRTUAL_CHOICES", "PipeSearch", "is_pipeline", "pipeline_row"]


class PipeSearch(GroupBounds, BlockFloors, MemoryFloors):
    """The pipeline part of one 4D search, sharing its :class:`~tetrad.plan.question.StepQuestion`,
    memory limit and statistics (``search``: a :class:`tetrad.plan.search.four_d._Search4D`)."""

    def __init__(self, search, modes: tuple[str, ...], allowed: set | None):
        self.s = search
        self.ctx = search.ctx
        self.modes = tuple(m for m in MODE_ORDER if m in modes)
        self.allowed = allowed
        self.fit_memo: dict = {}
        self.floor_memo: dict = {}
        self.comm_memo: dict = {}
        self.z_memo: dict = {}
        self.z_queue_memo: dict = {}
        self.turn_memo: dict = {}
        self.config_memo: dict = {}
        self.over_memo: dict = {}  # schedule -> the rank last found above the memory limit
        self._group_init()
        self._mem_init()
        self.stats = search.stats
        for k in ("pipe_groups", "pipe_candidates", "pipe_fitting", "pipe_evaluated"):
            self.stats.setdefault(k, 0)

    def extend(self, best: list, top: int, seq0: int) -> None:
        """Push the pipeline configurations that enter the top-K into ``best`` (the heap of
        :mod:`tetrad.plan.search.top`), numbered from ``seq0`` in enumeration order
        (:func:`_order`): :meth:`entries` visited best first
        (:func:`tetrad.plan.search.top.best_first`)."""
        self.seq = seq0
        numbers = itertools.count()
        queue = [(bound, kind, next(numbers), shape) for bound, kind, shape in self.entries()]
        heapq.heapify(queue)

        def visit(kind: int, payload) -> None:
            for entry in self.visit(kind, payload, best, top):
                heapq.heappush(queue, (*entry[:2], next(numbers), entry[2]))

        best_first(queue, best, top, visit, MARGIN)

    def entries(self) -> list[tuple[float, int, tuple]]:
        """``(bound 1, SHAPE, shape)`` of every tensor/context shape (:meth:`_tensor_groups`):
        where the search starts. None for a mixture-of-experts model: the split and the floors take
        every block alike (and ``tetrad plan`` and ``--grid auto`` refuse such models)."""
        if self.ctx.model.is_moe:
            return []
        return [(shape[0], SHAPE, shape) for shape in self._tensor_groups()]

    def visit(self, kind: int, payload: tuple, best: list, top: int) -> list[tuple]:
        """Visit an entry: a shape (:data:`SHAPE`) gives ``(bound 2, GROUP, group)`` of its
        groups below the slowest of ``best`` (:meth:`_pipe_group`); a group (:data:`GROUP`)
        times the schedules of its grids that may enter ``best`` and gives nothing."""
        limit = slowest(best, top)
        if kind == SHAPE:
            lb, gc, gy, gx, mode, per_sample, lb_kv = payload
            self.stats["pipe_groups"] += 1
            if lb_kv * (1 - MARGIN) >= limit:
                return []  # no group of this shape can enter (their context collectives)
            out = []
            for pipe in self.pipes:
                for group in self._pipe_group(pipe, gc, gy, gx, mode, per_sample, limit):
                    out.append((group[0], GROUP, group))
            return out
        _, pipe, q, gc, gy, gx, b, mode = payload
        for bound, grid, turn in self._group_grids(pipe, q, gc, gy, gx, b, mode, limit):
            if bound * (1 - MARGIN) < slowest(best, top):
                self._grid(best, top, pipe, grid, turn, b, mode)
        return []

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
                if "yx" in self.s.orientations(phys):
                    out.append((phys, "yx"))
            got = self.turn_memo[roles] = tuple(out)
        return got

    def _grid(self, best, top, pipe, grid, turn, b, mode) -> None:
        """Every schedule of ``grid`` in orientation ``turn``."""
        m = self.ctx.global_batch // (grid[0] * grid[2] * b)
        for cfg in self._configs(pipe, m):
            self.stats["pipe_candidates"] += 1
            if len(best) >= top and self._config_pruned(grid, turn, b, mode, cfg, m, -best[0][0]):
                continue
            for mem, zero in self._fitting(grid, turn, b, mode, cfg):
                self.stats["pipe_fitting"] += 1
                ctx = sharded(self.ctx) if zero else self.ctx
                if len(best) >= top and self._tail_pruned(
                    ctx, grid, turn, b, mode, cfg, m, -best[0][0]
                ):
                    continue
                self.stats["pipe_evaluated"] += 1
                est = pipeline_estimate(ctx, cfg, grid, b, mode, turn)
                item = (grid, b, mode, turn, (est, cfg, mem, zero))
                offer(
                    best, top, est.step_s, self.seq + _order(grid, turn, b, mode, cfg, zero), item
                )

    def _config_pruned(self, grid, turn, b, mode, cfg, m: int, limit: float) -> bool:
        """Whether the schedule cannot enter below ``limit`` seconds (less MARGIN) or cannot
        fit: cheapest first, bound 3, its memory floor, its slowest rank's time, then that plus
        the rank's tail in each optimizer variant the search may time it in."""
        keep = 1 - MARGIN
        if self._config_floor(grid, turn, b, mode, cfg, m) * keep >= limit:
            return True
        if self._memory_floor_fails(grid, turn, b, mode, cfg):
            return True
        if self._rank_floor(grid, turn, b, mode, cfg, m) * keep >= limit:
            return True
        roles = role_sizes(grid, turn)
        contexts = [
            sharded(self.ctx) if zero else self.ctx for zero in self.s.variants(roles[0] * roles[1])
        ]
        # with its tail in each optimizer variant it may be timed in
        return all(
            self._tail_pruned(ctx, grid, turn, b, mode, cfg, m, limit, every=False)
            for ctx in contexts
        )

    def _configs(self, pipe: int, m: int) -> tuple[PipeConfig, ...]:
        """The schedules of the module doc for ``p = pipe`` and ``m`` micro-batches
        (memoised)."""
        got = self.config_memo.get((pipe, m))
        if got is None:
            out = []
            if not schedule_problems("1f1b", pipe, 1, m):
                out.append(PipeConfig(pipe, 1, "1f1b"))
            else:
                out.append(PipeConfig(pipe, 1, "gpipe"))
            for v in VIRTUAL_CHOICES:
                if pipe * v <= self.ctx.model.n_layers and not schedule_problems(
                    "interleaved-1f1b", pipe, v, m
                ):
                    out.append(PipeConfig(pipe, v, "interleaved-1f1b"))
            got = self.config_memo[(pipe, m)] = tuple(out)
        return got

    def memory(self, grid, turn: str, b: int, mode: str, cfg: PipeConfig, zero: bool = False):
        """The worst rank's :class:`~tetrad.plan.memory.breakdown.MemoryBreakdown` and every
        rank's (:func:`tetrad.plan.memory.pipeline.pipeline_memory`; ``zero``: with the
        sharded optimizer)."""
        args, opts = self._memory_args(grid, turn, b, mode, cfg, zero)
        return pipeline_memory(*args[:-1], cfg.virtual, args[-1], **opts)

    def _memory_args(self, grid, turn, b, mode, cfg: PipeConfig, zero: bool) -> tuple:
        """``(model, roles, b, S, GPU bytes, ranks, schedule, m)`` and the options of
        :func:`~tetrad.plan.memory.pipeline.pipeline_memory` (``virtual`` left out)."""
        ctx, s = self.ctx, self.s
        roles = role_sizes(grid, turn)
        ranks = split_ranks(
            ctx.model.n_layers, split_costs(ctx.compute(roles, b), mode), cfg.pipe, cfg.virtual
        )
        m = ctx.global_batch // (grid[0] * grid[2] * b)
        args = (ctx.model, roles, b, ctx.seq_len, s.mem_bytes, ranks, cfg.schedule, m)
        opts = {
            "activation_checkpointing": mode,
            "dtype": s.dtype,
            "prefetch": s.prefetch,
            "shard_optimizer": zero,
        }
        return args, opts

    def _fits(self, grid, turn, b, mode, cfg, zero: bool = False):
        """The worst rank's memory (as :meth:`memory`'s) where every rank's is within 80% of
        the GPU's, else None: the ranks in order, the first above the limit ends it (memoised
        per roles: the two orientations of a grid hold the same)."""
        key = (role_sizes(grid, turn), b, mode, cfg, zero)
        got = self.fit_memo.get(key, 0)
        if got == 0 and self._memory_floor_fails(grid, turn, b, mode, cfg):
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
        limit, mems = FIT_FRACTION * self.s.mem_bytes, [None] * len(ranks)
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
        tries (:meth:`tetrad.plan.search.four_d._Search4D.variants`) where it fits and no
        cheaper mode fits in the same variant; under ``auto`` the sharded one only where the
        unsharded one does not fit."""
        out = []
        roles = role_sizes(grid, turn)
        for zero in self.s.variants(roles[0] * roles[1]):
            if zero and out:
                break  # auto: fits unsharded
            if any(
                cheaper in self.modes and self._fits(grid, turn, b, cheaper, cfg, zero) is not None
                for cheaper in MODE_ORDER[: MODE_ORDER.index(mode)]
            ):
                continue
            mem = self._fits(grid, turn, b, mode, cfg, zero)
            if mem is not None:
                out.append((mem, zero))
        return out


def _order(grid, turn: str, b: int, mode: str, cfg: PipeConfig, zero: bool) -> int:
    """The place of a pipeline configuration in enumeration order, a number (the top-K's ties
    go to the lower): ``G_pipe``, schedule, virtual stages, the roles' sizes, orientation
    (``xy`` first), micro-batch, checkpointing mode, optimizer variant, each in ascending
    order."""
    roles = role_sizes(grid, turn)
    fields = (
        (cfg.pipe, 16),
        (SCHEDULES.index(cfg.schedule), 2),
        (cfg.virtual, 8),
        *((size, 32) for size in roles),
        (ORIENTATIONS.index(turn), 1),
        (b, 32),
        (MODE_ORDER.index(mode), 2),
        (int(zero), 1),
    )
    out = 0
    for value, bits in fields:
        out = (out << bits) | value
    return out


def is_pipeline(est) -> bool:
    """Whether a ranked item's estimate is a pipeline's ``(PipeEstimate, PipeConfig, memory,
    sharded)``."""
    return isinstance(est, tuple) and isinstance(est[0], PipeEstimate)


def pipeline_row(search, step: float, grid, b: int, mode: str, turn: str, item) -> Row:
    """The :class:`~tetrad.plan.search.rows.Row` of a ranked pipeline configuration (``item``:
    its ``(PipeEstimate, PipeConfig, memory, sharded)``), with every rank's memory."""
    est, cfg, _, zero = item
    ctx = search.ctx
    worst, per_rank = PipeSearch(search, (mode,), None).memory(grid, turn, b, mode, cfg, zero)
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
        search.comm_model,
        {"pipeline_bubble": est.bubble_s},
        orientation=turn,
        pipe=cfg.pipe,
        virtual_stages=cfg.virtual,
        schedule=cfg.schedule,
        stage_memory=per_rank,
        shard_optimizer=zero,
    ).finish(ctx.model, ctx.machine, search.gpus, ctx.global_batch, ctx.seq_len)
