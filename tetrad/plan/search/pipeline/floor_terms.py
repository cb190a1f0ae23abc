"""The terms the pipeline search's floors are built from (:class:`FloorTerms`), each memoised per
shape so that every group, grid and schedule asking shares it (the package doc states the
bounds that add them up):

- a micro-batch's compute, of the whole model and of one block, and the stage split's costs
  (:meth:`FloorTerms.micro_batch_costs`);
- one block's exposed collectives per micro-batch: context K/V (per sample at least,
  :meth:`FloorTerms.kv_per_sample`; the least over ``G_z``, :meth:`FloorTerms.kv_floor`; on one
  ``G_z``, :meth:`FloorTerms.kv_seconds`), X/Y (:meth:`FloorTerms.xy_seconds`), and the Z
  seconds a rank of the most blocks cannot hide (:meth:`FloorTerms.z_floor`,
  :meth:`FloorTerms.z_exposed`); with the compute, bound 3's per-block terms
  (:meth:`FloorTerms.block_floor`, the same for every ``G_data``);
- the path into and out of the split's last rank of the most blocks, ``rho``: micro-batch 0's
  forward through stages ``0 .. rho - 1`` before its first operation and the last
  micro-batch's backward through them after its last (:meth:`FloorTerms.lead_seconds`), and
  the ranks' mean of the same floor (:meth:`FloorTerms.least_lead`).

Every term is at most what the estimate (:func:`tetrad.plan.pipe.pipeline_step.
pipeline_estimate`) counts for it (tests/test_plan_pipe_search.py).
"""

from __future__ import annotations

from tetrad.plan.comm.context_parallel import (
    PIECE_CANDIDATES,
    kv_gather_payload,
    pieces_exposed_seconds,
)
from tetrad.plan.comm.zwindows import window_seconds
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.pipe.pipeline_step import block_xy, split_key, split_ranks
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.pipeline.configs import VIRTUAL_CHOICES, pipe_sizes
from tetrad.plan.search.space import divisors_of
from tetrad.spec.grid import role_sizes
from tetrad.spec.units import FP32


class FloorTerms:
    """The floors' terms on one question, memoised.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        gpus: GPUs of every pipeline grid (``G_pipe`` times the 5D grid's).
    """

    def __init__(self, ctx: StepQuestion, gpus: int):
        self.ctx, self.gpus = ctx, gpus
        self.pipe_links = {
            p: ctx.machine.network.link(gpus // p, 2) for p in pipe_sizes(gpus, ctx.model.n_layers)
        }  # G_pipe -> the link of two ranks world / G_pipe apart (a stage boundary's)
        self.cost_memo: dict = {}  # (G_context, G_y, G_x, b, mode) -> (model, block, costs)
        self.kv_phase_memo: dict = {}  # (G_context, G_y, G_x) -> per sample (gather, scatter)
        self.kv_memo: dict = {}  # (G_data G_z, G_context, G_y, G_x, b, full) -> seconds
        self.kv_link_memo: dict = {}  # (G_context, G_x G_y G_z, G_y, b, full) -> seconds
        self.xy_memo: dict = {}  # (G_context, G_y, G_x, b, full, turn) -> seconds
        self.lead_memo: dict = {}  # (split_key, p, v) -> (rho, blocks before it)
        self.least_lead_memo: dict = {}  # (p, p divides m, split ratios) -> (rho, blocks), weighted
        self.floor_memo: dict = {}  # (grid but G_data, turn, b, mode) -> (block, costs)
        self.comm_memo: dict = {}  # (grid but G_data, turn, b, full) -> (compute, X/Y, K/V)
        self.z_memo: dict = {}  # (roles but G_data, b, full) -> (z_block, z_ends)
        self.z_queue_memo: dict = {}  # (G_z, G_x G_y, full) -> one block's Z queue, seconds

    def micro_batch_costs(self, gc: int, gy: int, gx: int, b: int, mode: str) -> tuple:
        """``(model, block, costs, ratios)``: one micro-batch's compute of the whole model
        (forward, backward, recompute), of one block, and the split's costs
        (:func:`tetrad.plan.pipe.stages.split_costs`), seconds, and the embedding's and head's
        cost in blocks as the split rounds them (:func:`~tetrad.plan.pipe.pipeline_step.split_key`,
        the same for every ``p`` and ``v``) (memoised)."""
        key = (gc, gy, gx, b, mode)
        got = self.cost_memo.get(key)
        if got is None:
            ctx, roles = self.ctx, (1, gc, 1, gy, gx)
            fwd, bwd, rec = ctx.micro_batch_seconds(roles, b, mode)
            costs = split_costs(ctx.compute(roles, b), mode)
            ratios = split_key(ctx.model.n_layers, costs, 1, 1)[1:3]
            got = self.cost_memo[key] = (fwd + bwd + rec, costs[0], costs, ratios)
        return got

    def most_blocks(self, pipe: int) -> int:
        """The fewest blocks the slowest of ``pipe`` ranks can hold: ``ceil(L / p)``."""
        return -(-self.ctx.model.n_layers // pipe)

    def kv_per_sample(self, gc: int, gy: int, gx: int, full: bool) -> float:
        """The ``L`` blocks' context K/V collectives per sample at least, seconds. Per phase
        their ring bytes over the best bandwidth of a context group of ``G_x G_y G_z`` stride
        take ``T`` per sample (latency left out; the bytes grow with the samples); the
        ``context`` overlap's ``n`` pieces (at most ``most``) expose
        ``t_1 + (n - 1) max(0, t_1 - a) - r`` with ``n t_1 >= T``, ``n a`` the phase's
        attention, ``A`` per sample, and ``r`` the queries' RoPE, ``R`` per sample: at least
        ``max(T / most, T - A) - R``
        (:func:`tetrad.plan.comm.context_parallel.pieces_exposed_seconds`)."""
        if gc == 1:
            return 0.0
        gather, scatter = self._kv_phases(gc, gy, gx)
        return self.ctx.model.n_layers * ((2 if full else 1) * gather + scatter)

    def _kv_phases(self, gc: int, gy: int, gx: int) -> tuple[float, float]:
        """``(gather, scatter)`` of :meth:`kv_per_sample`: one block's exposed all-gather and
        reduce-scatter per sample at least, seconds (memoised: every mode asks)."""
        got = self.kv_phase_memo.get(key := (gc, gy, gx))
        if got is None:
            ctx = self.ctx
            net, frac = ctx.machine.network, (gc - 1) / gc
            bw = max(net.link(gx * gy * gz, gc).bandwidth for gz in divisors_of(self.gpus // gc))
            t = frac * kv_gather_payload(ctx.model, 1, ctx.seq_len, gy, ctx.c) / bw
            comp = ctx.compute((1, gc, 1, gy, gx), 1)
            if "context" not in ctx.overlaps:
                gather = scatter = t
            else:
                most = ctx.context_pieces or PIECE_CANDIDATES[-1]
                gather = max(t / most, t - comp.attention)
                scatter = max(t / most, t - comp.attention_bwd)
            gather, scatter = max(0.0, gather - comp.rope_q), max(0.0, scatter - comp.rope_q_bwd)
            got = self.kv_phase_memo[key] = (gather, scatter)
        return got

    def kv_floor(self, q: int, gc: int, gy: int, gx: int, b: int, full: bool) -> float:
        """One block's context K/V collectives per micro-batch
        (:func:`tetrad.plan.comm.layers.context_kv`), the least over ``G_z`` dividing ``q``
        (the context group's stride is ``G_x G_y G_z``), seconds."""
        key = (q, gc, gy, gx, b, full)
        got = self.kv_memo.get(key)
        if got is None:
            got = min(self.kv_seconds(gc, gz, gy, gx, b, full) for gz in divisors_of(q))
            self.kv_memo[key] = got
        return got

    def kv_seconds(self, gc: int, gz: int, gy: int, gx: int, b: int, full: bool) -> float:
        """One block's context K/V collectives per micro-batch on ``G_z = gz``: their exposed
        seconds (:func:`tetrad.plan.comm.layers.context_kv`, memoised per link and payload)."""
        key = (gc, gx * gy * gz, gy, b, full)
        got = self.kv_link_memo.get(key)
        if got is None:
            ctx = self.ctx
            link = ctx.machine.network.link(gx * gy * gz, gc)
            comp = ctx.compute((1, gc, 1, gy, gx), b)
            k = ctx.kv_choice(b, gy, link, comp, full)[1]
            payload = kv_gather_payload(ctx.model, b, ctx.seq_len, gy, ctx.c) / k
            gather = link.time(ALL_GATHER, payload)
            gather = pieces_exposed_seconds(gather, comp.attention / k, k, comp.rope_q)
            scatter = link.time(REDUCE_SCATTER, payload)
            scatter = pieces_exposed_seconds(scatter, comp.attention_bwd / k, k, comp.rope_q_bwd)
            got = (2 * gather if full else gather) + scatter
            self.kv_link_memo[key] = got
        return got

    def known_xy(self, gc: int, gy: int, gx: int, b: int, full: bool) -> float:
        """The lesser of the shape's orientations' X/Y seconds where both are memoised already
        (another group of the shape asked), else 0: a free floor before the memory's."""
        got = self.xy_memo.get((gc, gy, gx, b, full, "xy"))
        if got is not None and gy > 1 and gx > 1:
            other = self.xy_memo.get((gc, gx, gy, b, full, "yx"))
            got = None if other is None else min(got, other)
        return got or 0.0

    def xy_seconds(self, grid, b: int, mode: str, turn: str) -> float:
        """One block's exposed X/Y collectives per micro-batch on ``grid`` in ``turn``
        (:func:`tetrad.plan.pipe.pipeline_step.block_xy`), seconds (memoised per shape)."""
        key = (grid[1], grid[3], grid[4], b, mode == "full", turn)
        got = self.xy_memo.get(key)
        if got is None:
            got = self.xy_memo[key] = sum(block_xy(self.ctx, grid, b, mode, turn)[0].values())
        return got

    def block_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """Bound 3's terms on ``grid``: ``(block, costs, z_block, z_ends)``: one block's compute
        and exposed X/Y and context collectives per micro-batch; the split's costs
        (:func:`tetrad.plan.pipe.stages.split_costs`); one block's Z queue less its windows and
        the windows of the embedding and head (a rank of ``k`` blocks exposes at least
        ``max(0, k z_block - z_ends)`` Z seconds per micro-batch:
        :func:`tetrad.plan.comm.zwindows.z_queue_seconds`)."""
        roles = role_sizes(grid, turn)
        return self.base_floor(grid, turn, b, mode) + self.z_floor(roles, b, mode == "full")

    def base_floor(self, grid, turn: str, b: int, mode: str) -> tuple:
        """``(block, costs)`` of :meth:`block_floor` (per micro-batch: every G_data's)."""
        got = self.floor_memo.get(key := (grid[1:], turn, b, mode))
        if got is None:
            comp, xy, kv = self._comm_floor(grid, turn, b, mode == "full")
            costs = split_costs(comp, mode)
            got = self.floor_memo[key] = (costs[0] + xy + kv, costs)
        return got

    def _comm_floor(self, grid, turn: str, b: int, full: bool) -> tuple:
        """``(compute, X/Y seconds, context seconds)`` for :meth:`block_floor`: its terms
        that depend on the mode only through ``full`` (as in ``make_step``)."""
        got = self.comm_memo.get(key := (grid[1:], turn, b, full))
        if got is None:
            ctx, mode = self.ctx, "full" if full else "none"
            _, gc, gz, gy, gx = roles = role_sizes(grid, turn)
            kv = self.kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
            xy = self.xy_seconds(grid, b, mode, turn)
            got = self.comm_memo[key] = (ctx.compute(roles, b), xy, kv)
        return got

    def z_floor(self, roles: tuple, b: int, full: bool) -> tuple[float, float]:
        """``(z_block, z_ends)`` of :meth:`block_floor` on the roles ``roles``: one block's Z
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
                gather = link.time(ALL_GATHER, shard * ctx.z_weight_bytes)
                got += phases * gather + link.time(REDUCE_SCATTER, shard * FP32)
            self.z_queue_memo[key] = got
        return got

    def z_exposed(self, pipe: int, gc: int, gz: int, gy: int, gx: int, b: int, full: bool):
        """The Z seconds per micro-batch a rank of ``ceil(L / pipe)`` blocks exposes at least
        on the roles ``(G_context, G_z, G_y, G_x)``: ``max(0, k z_block - z_ends)``."""
        if gz == 1:
            return 0.0
        z_block, z_ends = self.z_floor((1, gc, gz, gy, gx), b, full)
        return max(0.0, self.most_blocks(pipe) * z_block - z_ends)

    def least_lead(self, pipe: int, m: int, costs: tuple, one: float, ratios: tuple):
        """``(lead, mean)``: the least :meth:`lead_seconds` over the ``v`` the group's schedules
        may take (1, and :data:`VIRTUAL_CHOICES` where ``p`` divides ``m``; ``p v <= L``), and
        the least mean over ranks ``r`` of the same floor for ``r`` (each rank is idle at least
        that long, so the step is at least it plus ``m`` times the mean ``T_r``), seconds
        (``ratios``: the costs' split ratios, :meth:`micro_batch_costs`)."""
        L = self.ctx.model.n_layers
        # the splits depend on the costs through split_key's rounded ratios only
        key = (pipe, m % pipe == 0, *ratios)
        got = self.least_lead_memo.get(key)
        if got is None:
            vs = [v for v in (1,) + (VIRTUAL_CHOICES if key[1] else ()) if pipe * v <= L]
            splits = [self.lead_split(pipe, v, costs) for v in vs]
            # the splits no other is at or below in both rho and blocks: the least lead's
            pairs = {(r, n) for r, n, _ in splits}
            lowest = [a for a in pairs if all(b == a for b in _pareto(pairs, a))]
            got = self.least_lead_memo[key] = (lowest, min(w for _, _, w in splits))
        lowest, weighted = got
        lead = min(n * costs[0] + costs[1] + (2 * r - 1) * one if r else 0.0 for r, n in lowest)
        p = pipe
        return lead, (weighted * costs[0] + (p - 1) * (costs[1] + (p - 1) * one)) / p

    def lead_split(self, pipe: int, virtual: int, costs: tuple) -> tuple[int, int, int]:
        """``(rho, blocks, weighted)`` of the split
        (:func:`tetrad.plan.pipe.pipeline_step.split_ranks`, memoised): ``rho`` the last rank of the
        most blocks (at least ``ceil(L / p)``), ``blocks`` those of stages ``0 .. rho - 1``,
        ``weighted`` the sum over ranks ``r`` of the blocks of stages ``0 .. r - 1``."""
        L = self.ctx.model.n_layers
        key = split_key(L, costs, pipe, virtual)
        got = self.lead_memo.get(key)
        if got is None:
            ranks = split_ranks(L, costs, pipe, virtual)
            most = max(r.blocks for r in ranks)
            rho = max(r.rank for r in ranks if r.blocks == most)
            firsts = [r.chunk_blocks[0] for r in ranks]
            weighted = sum(n * (pipe - 1 - q) for q, n in enumerate(firsts))
            got = self.lead_memo[key] = (rho, sum(firsts[:rho]), weighted)
        return got

    def lead_seconds(self, pipe: int, virtual: int, costs: tuple, one: float) -> float:
        """A floor of the path into and out of rank ``rho`` (:meth:`lead_split`): micro-batch
        0's forward through stages ``0 .. rho - 1`` before its first operation and the last
        micro-batch's backward through them after its last (in GPipe, 1F1B and interleaved 1F1B
        a rank starts with its first stage's first forward and ends with its last backward),
        each stage's compute (its blocks, the embedding on stage 0) and receives (``2 rho -
        1``); the step is at least this plus ``m T_rho`` (:mod:`tetrad.plan.pipe.critical_path`),
        seconds."""
        return _lead(self.lead_split(pipe, virtual, costs), costs, one)


def _pareto(pairs, a: tuple) -> list:
    """The pairs at or below ``a`` in both entries."""
    return [b for b in pairs if b[0] <= a[0] and b[1] <= a[1]]


def _lead(split: tuple, costs: tuple, one: float) -> float:
    """:meth:`FloorTerms.lead_seconds` of a :meth:`FloorTerms.lead_split`."""
    rho, blocks, _ = split
    return blocks * costs[0] + costs[1] + (2 * rho - 1) * one if rho else 0.0
