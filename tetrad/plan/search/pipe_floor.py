"""Bound 3's per-block terms of :class:`tetrad.plan.search.pipelined.PipeSearch`
(:class:`BlockFloors`), memoised per micro-batch: the same for every ``G_data``."""

from __future__ import annotations

from tetrad.plan.comm import layers
from tetrad.plan.comm.estimate import make_step
from tetrad.plan.comm.record import Recorder
from tetrad.plan.comm.zwindows import window_seconds, z_queue_seconds
from tetrad.plan.pipe.estimate import block_xy, stage_context
from tetrad.plan.pipe.stages import split_costs
from tetrad.spec import role_sizes


class BlockFloors:
    """The terms of bound 3 on a grid (``self.ctx``: the search's
    :class:`~tetrad.plan.comm.context.Context`), memoised in ``floor_memo``, ``comm_memo`` and
    ``z_memo``."""

    def _block_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """Bound 3's terms on ``grid``: ``(block, costs, z_block, z_ends)``: one block's compute
        and exposed X/Y and context collectives per micro-batch; the split's costs
        (:func:`tetrad.plan.pipe.stages.split_costs`); one block's Z queue less its windows and
        the windows of the embedding and head (a rank of ``k`` blocks exposes at least
        ``max(0, k z_block - z_ends)`` Z seconds per micro-batch:
        :func:`tetrad.plan.comm.zwindows.z_queue_seconds`)."""
        return self._base_floor(grid, turn, b, mode) + self._z_floor(grid, turn, b, mode == "full")

    def _base_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """``(block, costs)`` of :meth:`_block_floor` (per micro-batch: every G_data's)."""
        got = self.floor_memo.get(key := (grid[1:], turn, b, mode))
        if got is None:
            comp, xy, kv, _ = self._comm_floor(grid, turn, b, mode == "full")
            costs = split_costs(comp, mode)
            got = self.floor_memo[key] = (costs[0] + xy + kv, costs)
        return got

    def _comm_floor(self, grid, turn: str, b: int, full: bool) -> tuple:
        """``(compute, X/Y seconds, context seconds, step)`` for :meth:`_block_floor`: its terms
        that depend on the mode only through ``full`` (as in ``make_step``)."""
        got = self.comm_memo.get(key := (grid[1:], turn, b, full))
        if got is None:
            ctx, mode = self.ctx, "full" if full else "none"
            st = make_step(ctx, grid, b, mode, turn)
            rec = Recorder(False)
            layers.context_kv(rec, st)
            xy = sum(block_xy(ctx, grid, b, mode, turn)[0].values())
            comp = ctx.compute(role_sizes(grid, turn), b)
            kv = sum(rec.exposed.values()) / (st.acc * ctx.model.n_layers)
            got = self.comm_memo[key] = (comp, xy, kv, st)
        return got

    def _z_floor(self, grid, turn: str, b: int, full: bool) -> tuple[float, float]:
        """``(z_block, z_ends)`` of :meth:`_block_floor`."""
        got = self.z_memo.get(key := (grid[1:], turn, b, full))
        if got is None:
            ctx, L = self.ctx, self.ctx.model.n_layers
            comp, _, _, st = self._comm_floor(grid, turn, b, full)
            z_block, z_ends = 0.0, 0.0
            if st.sizes["z"] > 1 and L > 1:
                one = make_step(stage_context(ctx, 1), grid, b, "full" if full else "none", turn)
                zq = (z_queue_seconds(st) - z_queue_seconds(one)) / (L - 1)
                z_block = zq - window_seconds(comp, 1, st.checkpointing)
                z_block += window_seconds(comp, 0, st.checkpointing)
                z_ends = window_seconds(comp, 0, st.checkpointing)
            got = self.z_memo[key] = (z_block, z_ends)
        return got
