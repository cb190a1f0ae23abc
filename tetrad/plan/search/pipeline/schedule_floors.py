"""Bound 3 of the pipeline search and the floors of one schedule (:class:`ScheduleFloors`; the
package doc, :mod:`tetrad.plan.search.pipeline`, states them):

- bound 3 (:meth:`ScheduleFloors.config_floor`): ``m`` times a rank of ``ceil(L / p)`` blocks,
  their compute, X/Y, context and Z floor and the fewest point-to-point receives of a rank,
  plus the way in and out of the split's last rank of the most blocks (the per-block terms:
  :meth:`tetrad.plan.search.pipeline.floor_terms.FloorTerms.block_floor`, memoised per
  micro-batch: the same for every ``G_data``);
- the rank floor (:meth:`ScheduleFloors.rank_floor`): ``m`` times that rank's time as the
  estimate has it (:func:`tetrad.plan.pipe.pipeline_step.rank_time`, shared with it) plus the
  same way in and out;
- that floor plus a rank's tail (the optimizer and what the cool-down leaves exposed,
  :func:`tetrad.plan.pipe.pipeline_step.rank_tail`), that rank's first, then each's: the step
  adds the largest (:meth:`ScheduleFloors.tail_pruned`).

Every floor is at most the critical path of
:func:`tetrad.plan.pipe.critical_path.schedule_step` (whose module doc gives the paths) plus
the largest tail, the estimate's step.
"""

from __future__ import annotations

from tetrad.plan.pipe.pipeline_step import PipeConfig, cached_rank_time, rank_tail, split_ranks
from tetrad.plan.pipe.schedule import boundaries_of_rank, p2p_bytes
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.pipeline.floor_terms import FloorTerms
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.spec.grid import role_sizes


class ScheduleFloors:
    """The floors of one schedule on one grid.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        terms: the floors' memoised terms.
    """

    def __init__(self, ctx: StepQuestion, terms: FloorTerms):
        self.ctx, self.terms = ctx, terms

    def config_floor(self, grid, turn, b, mode, cfg: PipeConfig, m: int) -> float:
        """Bound 3 (module doc): ``m`` times a rank of ``ceil(L / p)`` blocks: their compute,
        X/Y, context and Z floor, and the fewest point-to-point receives of a rank (``2 v -
        1``): the slowest rank runs ``m`` such micro-batches one after another, whatever the
        schedule (:func:`tetrad.plan.pipe.critical_path.schedule_step` is never below ``m
        max_r T_r``; the bubble depends on the other ranks, see :meth:`rank_floor`)."""
        ctx, p = self.ctx, cfg.pipe
        block, _, zb, ze = self.terms.block_floor(grid, turn, b, mode)
        roles = role_sizes(grid, turn)
        split = ctx.sequence_split(roles[1], roles[3], roles[4])
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.dim, roles[1], roles[4], ctx.c, split)
        world5 = grid[0] * grid[1] * grid[2] * grid[3] * grid[4]
        link = ctx.machine.network.link(world5, 2)
        one = link.base_latency + nbytes / link.bandwidth
        k = self.terms.most_blocks(p)
        slowest = k * block + max(0.0, k * zb - ze) + (2 * cfg.virtual - 1) * one
        costs = self.terms.base_floor(grid, turn, b, mode)[1]
        out = m * slowest + self.terms.lead_seconds(p, cfg.virtual, costs, one)
        if cfg.schedule == "gpipe":  # sum_r T_r + (m - 1) max_r T_r at least
            L = ctx.model.n_layers
            out = max(out, (m - 1) * slowest + L * block + 2 * (p - 1) * one)
        return out

    def rank_floor(self, grid, turn, b, mode, cfg: PipeConfig, m: int) -> float:
        """The estimate's step without its tail, bounded below: ``m T_rho`` of the last rank
        ``rho`` of the most blocks (:func:`~tetrad.plan.pipe.pipeline_step.rank_time`, shared with
        the estimate) plus the path into and out of it
        (:meth:`~tetrad.plan.search.pipeline.floor_terms.FloorTerms.lead_seconds`), seconds."""
        return self.rank_path(self.ctx, grid, turn, b, mode, cfg, m)[0]

    def rank_path(self, ctx, grid, turn, b, mode, cfg: PipeConfig, m: int) -> tuple:
        """``(floor, rho, ranks)``: :meth:`rank_floor` on ``ctx`` (the search's or its
        sharded-optimizer one), the index of ``rho`` and the split's
        :class:`~tetrad.plan.pipe.stages.PipeRank` s, as the estimate splits."""
        p = cfg.pipe
        costs = split_costs(ctx.compute(role_sizes(grid, turn), b), mode)
        ranks = split_ranks(ctx.model.n_layers, costs, p, cfg.virtual)
        most = max(r.blocks for r in ranks)
        rho = max(r.rank for r in ranks if r.blocks == most)
        rt = cached_rank_time(ctx, grid, b, mode, turn, ranks[rho], cfg)
        one = rt.p2p / sum(boundaries_of_rank(p, rho, cfg.virtual))
        floor = m * rt.per_micro_batch + self.terms.lead_seconds(p, cfg.virtual, costs, one)
        return floor, rho, ranks

    def tail_pruned(
        self, ctx, grid, turn, b, mode, cfg: PipeConfig, m: int, limit: float, every=True
    ) -> bool:
        """Whether the estimate on ``ctx`` cannot come below ``limit`` seconds (less MARGIN):
        its step is the critical path, at least :meth:`rank_floor`, plus the largest of the
        ranks' tails (:func:`~tetrad.plan.pipe.pipeline_step.rank_tail`), at least ``rho``'s, then
        (``every``) at least every rank's (their times, memoised, are the estimate's)."""
        keep = 1 - MARGIN
        floor, rho, ranks = self.rank_path(ctx, grid, turn, b, mode, cfg, m)
        times = [None] * len(ranks)
        for i in (rho, *range(len(ranks) if every else 0)):
            if times[i] is None:
                times[i] = cached_rank_time(ctx, grid, b, mode, turn, ranks[i], cfg)
                if (floor + rank_tail(times[i], i, cfg.virtual)) * keep >= limit:
                    return True
        return False
