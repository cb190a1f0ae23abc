"""Bound 3's per-block terms of :class:`tetrad.plan.search.pipeline.pipe_search.PipeSearch`
(:class:`BlockFloors`), memoised per micro-batch: the same for every ``G_data``."""

from __future__ import annotations

from tetrad.plan.comm.zwindows import window_seconds
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.pipe.pipeline_step import PipeConfig, cached_rank_time, rank_tail, split_ranks
from tetrad.plan.pipe.schedule import boundaries_of_rank, p2p_bytes
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.spec import FP32, role_sizes


class BlockFloors:
    """The terms of bound 3 on a grid (``self.ctx``: the search's
    :class:`~tetrad.plan.question.StepQuestion`), memoised in ``floor_memo``, ``comm_memo`` and
    ``z_memo``."""

    def _block_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """Bound 3's terms on ``grid``: ``(block, costs, z_block, z_ends)``: one block's compute
        and exposed X/Y and context collectives per micro-batch; the split's costs
        (:func:`tetrad.plan.pipe.stages.split_costs`); one block's Z queue less its windows and
        the windows of the embedding and head (a rank of ``k`` blocks exposes at least
        ``max(0, k z_block - z_ends)`` Z seconds per micro-batch:
        :func:`tetrad.plan.comm.zwindows.z_queue_seconds`)."""
        roles = role_sizes(grid, turn)
        return self._base_floor(grid, turn, b, mode) + self._z_floor(roles, b, mode == "full")

    def _base_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """``(block, costs)`` of :meth:`_block_floor` (per micro-batch: every G_data's)."""
        got = self.floor_memo.get(key := (grid[1:], turn, b, mode))
        if got is None:
            comp, xy, kv = self._comm_floor(grid, turn, b, mode == "full")
            costs = split_costs(comp, mode)
            got = self.floor_memo[key] = (costs[0] + xy + kv, costs)
        return got

    def _comm_floor(self, grid, turn: str, b: int, full: bool) -> tuple:
        """``(compute, X/Y seconds, context seconds)`` for :meth:`_block_floor`: its terms
        that depend on the mode only through ``full`` (as in ``make_step``)."""
        got = self.comm_memo.get(key := (grid[1:], turn, b, full))
        if got is None:
            ctx, mode = self.ctx, "full" if full else "none"
            _, gc, gz, gy, gx = roles = role_sizes(grid, turn)
            kv = self._kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
            xy = self._xy_seconds(grid, b, mode, turn)
            got = self.comm_memo[key] = (ctx.compute(roles, b), xy, kv)
        return got

    def _z_floor(self, roles: tuple, b: int, full: bool) -> tuple[float, float]:
        """``(z_block, z_ends)`` of :meth:`_block_floor` on the roles ``roles``: one block's Z
        queue (:func:`tetrad.plan.comm.zwindows.z_queue_seconds` per block: every block
        Linear's all-gather in each phase and its reduce-scatter) less the block's windows, and
        the embedding's and head's windows (:func:`~tetrad.plan.comm.zwindows.window_seconds`).
        """
        got = self.z_memo.get(key := (*roles[1:], b, full))
        if got is None:
            z_block, z_ends = 0.0, 0.0
            gz, xy = roles[2], roles[3] * roles[4]
            if gz > 1:
                comp = self.ctx.compute(roles, b)
                z_ends = window_seconds(comp, 0, full)
                z_block = self._z_queue(gz, xy, full) - (window_seconds(comp, 1, full) - z_ends)
            got = self.z_memo[key] = (z_block, z_ends)
        return got

    def _z_queue(self, gz: int, xy: int, full: bool) -> float:
        """One block's Z queue on ``G_z = gz`` of stride ``G_x G_y = xy``, seconds: every block
        Linear's all-gather in each phase (3 with ``full`` recompute, else 2) and its
        reduce-scatter (memoised: every context split and micro-batch shares it)."""
        key = (gz, xy, full)
        got = self.z_queue_memo.get(key)
        if got is None:
            ctx, phases = self.ctx, 3 if full else 2
            link = ctx.machine.network.link(xy, gz)
            got = 0.0
            for lin in ctx.linears:
                shard = lin.weight_elements * lin.count / xy
                gather = link.time(ALL_GATHER, shard * ctx.c)
                got += phases * gather + link.time(REDUCE_SCATTER, shard * FP32)
            self.z_queue_memo[key] = got
        return got

    def _z_exposed(self, pipe: int, gc: int, gz: int, gy: int, gx: int, b: int, full: bool):
        """The Z seconds per micro-batch a rank of ``ceil(L / pipe)`` blocks exposes at least
        on the roles ``(G_context, G_z, G_y, G_x)``: ``max(0, k z_block - z_ends)``."""
        if gz == 1:
            return 0.0
        z_block, z_ends = self._z_floor((1, gc, gz, gy, gx), b, full)
        return max(0.0, self._most_blocks(pipe) * z_block - z_ends)

    def _config_floor(self, grid, turn, b, mode, cfg: PipeConfig, m: int) -> float:
        """Bound 3 (module doc): ``m`` times a rank of ``ceil(L / p)`` blocks: their compute,
        X/Y, context and Z floor, and the fewest point-to-point receives of a rank (``2 v -
        1``): the slowest rank runs ``m`` such micro-batches one after another, whatever the
        schedule (:func:`tetrad.plan.pipe.critical_path.schedule_step` is never below ``m
        max_r T_r``; the bubble depends on the other ranks, see :meth:`_rank_floor`)."""
        ctx, p = self.ctx, cfg.pipe
        block, _, zb, ze = self._block_floor(grid, turn, b, mode)
        roles = role_sizes(grid, turn)
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.hidden, roles[1], roles[4], ctx.c)
        world5 = grid[0] * grid[1] * grid[2] * grid[3] * grid[4]
        link = ctx.machine.network.link(world5, 2)
        one = link.base_latency + nbytes / link.bandwidth
        k = self._most_blocks(p)
        slowest = k * block + max(0.0, k * zb - ze) + (2 * cfg.virtual - 1) * one
        costs = self._base_floor(grid, turn, b, mode)[1]
        out = m * slowest + self._lead_seconds(p, cfg.virtual, costs, one)
        if cfg.schedule == "gpipe":  # sum_r T_r + (m - 1) max_r T_r at least
            L = ctx.model.n_layers
            out = max(out, (m - 1) * slowest + L * block + 2 * (p - 1) * one)
        return out

    def _rank_floor(self, grid, turn, b, mode, cfg: PipeConfig, m: int) -> float:
        """The estimate's step without its tail, bounded below: ``m T_rho`` of the last rank
        ``rho`` of the most blocks (:func:`~tetrad.plan.pipe.pipeline_step.rank_time`, shared with
        the estimate) plus the path into and out of it
        (:meth:`~tetrad.plan.search.pipeline.group_bounds.GroupBounds._lead_seconds`), seconds."""
        return self._rank_path(self.ctx, grid, turn, b, mode, cfg, m)[0]

    def _rank_path(self, ctx, grid, turn, b, mode, cfg: PipeConfig, m: int) -> tuple:
        """``(floor, rho, ranks)``: :meth:`_rank_floor` on ``ctx`` (the search's or its
        sharded-optimizer one), the index of ``rho`` and the split's
        :class:`~tetrad.plan.pipe.stages.PipeRank` s, as the estimate splits."""
        p = cfg.pipe
        costs = split_costs(ctx.compute(role_sizes(grid, turn), b), mode)
        ranks = split_ranks(ctx.model.n_layers, costs, p, cfg.virtual)
        most = max(r.blocks for r in ranks)
        rho = max(r.rank for r in ranks if r.blocks == most)
        rt = cached_rank_time(ctx, grid, b, mode, turn, ranks[rho], cfg)
        one = rt.p2p / sum(boundaries_of_rank(p, rho, cfg.virtual))
        floor = m * rt.per_micro_batch + self._lead_seconds(p, cfg.virtual, costs, one)
        return floor, rho, ranks

    def _tail_pruned(
        self, ctx, grid, turn, b, mode, cfg: PipeConfig, m: int, limit: float, every=True
    ) -> bool:
        """Whether the estimate on ``ctx`` cannot come below ``limit`` seconds (less MARGIN):
        its step is the critical path, at least :meth:`_rank_floor`, plus the largest of the
        ranks' tails (:func:`~tetrad.plan.pipe.pipeline_step.rank_tail`), at least ``rho``'s, then
        (``every``) at least every rank's (their times, memoised, are the estimate's)."""
        keep = 1 - MARGIN
        floor, rho, ranks = self._rank_path(ctx, grid, turn, b, mode, cfg, m)
        times = [None] * len(ranks)
        for i in (rho, *range(len(ranks) if every else 0)):
            if times[i] is None:
                times[i] = cached_rank_time(ctx, grid, b, mode, turn, ranks[i], cfg)
                if (floor + rank_tail(times[i], i, cfg.virtual)) * keep >= limit:
                    return True
        return False
