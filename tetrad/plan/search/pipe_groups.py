"""Bounds 1 and 2 of the pipeline search (:class:`GroupBounds`, a part of
:class:`tetrad.plan.search.pipelined.PipeSearch`, whose module doc states them): the tensor
shapes ``(G_context, G_y, G_x, mode)`` and the groups ``(G_pipe, G_context, G_y, G_x, b,
mode)`` on them, and what rejects a whole group, or a grid of it, before its schedules are
enumerated (:meth:`GroupBounds._group_grids`):

- its context K/V collectives, the least over ``G_z`` (cheap: two link times per ``G_z``);
- its memory floor (:mod:`tetrad.plan.search.pipe_memory`), whatever the time: the ``G_z``
  that can fit;
- per ``G_z``, its context collectives and the Z seconds a rank of the most blocks cannot hide
  (:mod:`tetrad.plan.search.pipe_floor`);
- per grid, its blocks' exposed X/Y collectives (memoised per shape and orientation).

A rank's per-micro-batch time is at least ``k (c_block + x) + z`` on a rank of the most blocks
``k = ceil(L / p)`` and at least the average ``c_model / p + (L / p) x`` (``x``: a block's
collectives per micro-batch, ``z`` the Z floor; every rank receives at least one
point-to-point message), times ``m + (p - 1) / v`` with the largest ``v`` allowed.
"""

from __future__ import annotations

from tetrad.plan.comm.bounds import MARGIN
from tetrad.plan.comm.context_parallel import (
    PIECE_CANDIDATES,
    context_problems,
    kv_gather_payload,
    pieces_exposed_seconds,
)
from tetrad.plan.compute.block import block_compute
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.pipe.estimate import block_xy
from tetrad.plan.pipe.schedule import p2p_bytes
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.search.space import divisors_of

VIRTUAL_CHOICES = (2, 3, 4, 5, 6, 8)
"""Virtual stages per rank tried with ``interleaved-1f1b`` (NVIDIA's Llama-3 recipes use 5 and
8, torchtitan 2 by default)."""


class GroupBounds:
    """Bounds 1 and 2 and the group tests of the module doc; ``self.ctx``, ``self.s`` (the 4D
    search), ``self.modes`` and ``self.allowed`` come from the search."""

    def _group_init(self) -> None:
        L = self.ctx.model.n_layers
        self.pipes = [p for p in divisors_of(self.s.gpus) if 2 <= p <= L]
        self.vmax = {
            p: max((v for v in VIRTUAL_CHOICES if p * v <= L), default=0) for p in self.pipes
        }
        self.cost_memo: dict = {}  # (G_context, G_y, G_x, b, mode) -> (model, block, costs)
        self.kv_memo: dict = {}  # (G_data G_z, G_context, G_y, G_x, b, full) -> seconds
        self.kv_link_memo: dict = {}  # (G_context, G_x G_y G_z, G_y, b, full) -> seconds
        self.xy_memo: dict = {}  # (G_context, G_y, G_x, b, full, turn) -> seconds

    def _per_sample_floors(self, gc: int, gy: int, gx: int) -> dict[str, float]:
        """Bound 1 per sample of one ``(G_context, G_y, G_x)`` rank, per mode: the blocks'
        compute of one sample with every GEMM at the machine's best efficiency."""
        ctx = self.ctx
        best = max(e for _, e in ctx.machine.gemm_table)
        comp = block_compute(
            ctx.model,
            ctx.machine,
            (1, gc, 1, gy, gx),
            1,
            ctx.seq_len,
            linears=ctx.linears,
            gemm_efficiency=lambda f: best,
        )
        rec = {"full": comp.block_fwd, "selective": comp.selective, "none": 0.0}
        base = comp.block_fwd + comp.block_bwd
        return {m: ctx.model.n_layers * (base + rec[m]) for m in self.modes}

    def _tensor_groups(self) -> list:
        """``(bound 1, G_context, G_y, G_x, mode, per sample, with context)`` of every
        tensor/context shape (the roles' sizes) that shards the model; ``per sample``: bound
        1's seconds per sample with the blocks' context collectives (:meth:`_kv_per_sample`);
        ``with context``: bound 1 with them."""
        ctx, gpus, model = self.ctx, self.s.gpus, self.ctx.model
        out = []
        for gc in divisors_of(gpus // 2):
            if gc > 1 and context_problems(ctx.seq_len, gc):
                continue
            for gy in divisors_of(gpus // (2 * gc)):
                for gx in divisors_of(gpus // (2 * gc * gy)):
                    if grid_problems(model, (1, gc, 1, gy, gx)):
                        continue
                    share = ctx.global_batch * gc * gy * gx / gpus
                    for mode, floor in self._per_sample_floors(gc, gy, gx).items():
                        kv = floor + self._kv_per_sample(gc, gy, gx, mode == "full")
                        out.append((share * floor, gc, gy, gx, mode, kv, share * kv))
        out.sort(key=lambda t: t[0])
        return out

    def _kv_per_sample(self, gc: int, gy: int, gx: int, full: bool) -> float:
        """The ``L`` blocks' context K/V collectives per sample at least, seconds. Per phase
        their ring bytes over the best bandwidth of a context group of ``G_x G_y G_z`` stride
        take ``T`` per sample (latency left out; the bytes grow with the samples); the
        ``context`` overlap's ``n`` pieces (at most ``most``) expose
        ``t_1 + (n - 1) max(0, t_1 - a)`` with ``n t_1 >= T`` and ``n a`` the phase's
        attention, ``A`` per sample: at least ``max(T / most, T - A)``
        (:func:`tetrad.plan.comm.context_parallel.pieces_exposed_seconds`)."""
        if gc == 1:
            return 0.0
        ctx = self.ctx
        net, frac = ctx.machine.network, (gc - 1) / gc
        bw = max(net.link(gx * gy * gz, gc).bandwidth for gz in divisors_of(self.s.gpus // gc))
        t = frac * kv_gather_payload(ctx.model, 1, ctx.seq_len, gy, ctx.c) / bw
        if "context" not in ctx.overlaps:
            gather = scatter = t
        else:
            most = ctx.context_pieces or PIECE_CANDIDATES[-1]
            comp = ctx.compute((1, gc, 1, gy, gx), 1)
            gather = max(t / most, t - comp.attention)
            scatter = max(t / most, t - comp.attention_bwd)
        return ctx.model.n_layers * ((2 if full else 1) * gather + scatter)

    def _mb_costs(self, gc: int, gy: int, gx: int, b: int, mode: str) -> tuple:
        """``(model, block, costs)``: one micro-batch's compute of the whole model (forward,
        backward, recompute), of one block, and the split's costs
        (:func:`tetrad.plan.pipe.stages.split_costs`), seconds (memoised)."""
        key = (gc, gy, gx, b, mode)
        got = self.cost_memo.get(key)
        if got is None:
            ctx, roles = self.ctx, (1, gc, 1, gy, gx)
            fwd, bwd, rec = ctx.micro_batch_seconds(roles, b, mode)
            costs = split_costs(ctx.compute(roles, b), mode)
            got = self.cost_memo[key] = (fwd + bwd + rec, costs[0], costs)
        return got

    def _most_blocks(self, pipe: int) -> int:
        """The fewest blocks the slowest of ``pipe`` ranks can hold: ``ceil(L / p)``."""
        return -(-self.ctx.model.n_layers // pipe)

    def _bubble_factor(self, pipe: int, m: int) -> float:
        """``m + (p - 1) / v`` with the largest ``v`` allowed (bound 2)."""
        v = self.vmax[pipe] if self.vmax[pipe] and m % pipe == 0 else 1
        return m + (pipe - 1) / v

    def _pipe_group(self, pipe, gc, gy, gx, mode, per_sample: float, limit: float) -> list:
        """Bound 2 of each micro-batch of ``G_pipe = pipe`` on the roles ``(G_context, G_y,
        G_x)``: ``(bound, pipe, G_data G_z, G_context, G_y, G_x, b, mode)``, those below
        ``limit`` (less MARGIN) only. The micro-batches ascend and stop where ``B / (G_data
        G_z) + (p - 1) b / v`` samples at ``per_sample`` seconds (:meth:`_tensor_groups`) over
        ``p`` (the steps and the bubble, a floor of every group bound that grows with ``b``)
        reach ``limit``."""
        out = []
        if (self.s.gpus // pipe) % (gc * gy * gx):
            return out
        q = self.s.gpus // (pipe * gc * gy * gx)  # G_data G_z
        if self.ctx.global_batch % q:
            return out
        per_cell, k = self.ctx.global_batch // q, self._most_blocks(pipe)
        bubble = (pipe - 1) / max(self.vmax[pipe], 1)
        for b in divisors_of(per_cell):
            if (per_cell + bubble * b) * per_sample / pipe * (1 - MARGIN) >= limit:
                break
            if self.allowed is not None and b not in self.allowed:
                continue
            model, block, _ = self._mb_costs(gc, gy, gx, b, mode)
            lb = self._bubble_factor(pipe, per_cell // b) * max(model / pipe, k * block)
            if lb * (1 - MARGIN) < limit:
                out.append((lb, pipe, q, gc, gy, gx, b, mode))
        return out

    def _group_bound(self, pipe, q, gc, gy, gx, b, mode, extra: float, z: float = 0.0) -> float:
        """Bound 2 with ``extra`` seconds per block and micro-batch on every block, ``z``
        exposed Z seconds per micro-batch on a rank of the most blocks, and one point-to-point
        receive per rank (module doc)."""
        return _bound(self._bound_terms(pipe, q, gc, gy, gx, b, mode), extra, z)

    def _bound_terms(self, pipe, q, gc, gy, gx, b, mode) -> tuple:
        """``(m + (p - 1) / v, model / p, L / p, k, block, one receive)`` of
        :meth:`_group_bound`, seconds."""
        ctx = self.ctx
        model, block, _ = self._mb_costs(gc, gy, gx, b, mode)
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.hidden, gc, gx, ctx.c)
        link = ctx.machine.network.link(self.s.gpus // pipe, 2)
        one = link.base_latency + nbytes / link.bandwidth
        bf = self._bubble_factor(pipe, ctx.global_batch // (q * b))
        L, k = ctx.model.n_layers, self._most_blocks(pipe)
        return bf, model / pipe, L / pipe, k, block, one

    def _group_grids(self, pipe, q, gc, gy, gx, b, mode, limit: float) -> list:
        """``(bound, --grid, orientation)`` of the group's grids whose memory floor fits and
        whose bound is below ``limit`` seconds (less MARGIN; ``inf``: every grid that fits,
        bound 0), in ascending ``G_z`` and orientation order. Cheapest first: the context
        collectives at their least over ``G_z``, the memory floor (the ``G_z`` it leaves), per
        ``G_z`` the context and Z floors (:meth:`_z_exposed`), then per orientation the X/Y
        collectives (:meth:`_xy_seconds`)."""
        full, timed = mode == "full", limit < float("inf")
        terms = self._bound_terms(pipe, q, gc, gy, gx, b, mode) if timed else None
        cap = limit / (1 - MARGIN)  # a bound at or above it prunes
        if timed:
            kv = self._kv_floor(q, gc, gy, gx, b, full) if gc > 1 else 0.0
            if _bound(terms, kv + self._known_xy(gc, gy, gx, b, full)) >= cap:
                return []
        out = []
        for gz in self._fitting_z(pipe, q, gc, gy, gx, b, mode):
            turns = self._turns((q // gz, gc, gz, gy, gx))
            if not timed:
                out += [(0.0, grid, turn) for grid, turn in turns]
                continue
            kv = self._kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
            z = self._z_exposed(pipe, gc, gz, gy, gx, b, full)
            if _bound(terms, kv, z) >= cap:
                continue
            for grid, turn in turns:
                bound = _bound(terms, kv + self._xy_seconds(grid, b, mode, turn), z)
                if bound < cap:
                    out.append((bound, grid, turn))
        return out

    def _known_xy(self, gc: int, gy: int, gx: int, b: int, full: bool) -> float:
        """The lesser of the shape's orientations' X/Y seconds where both are memoised already
        (another group of the shape asked), else 0: a free floor before the memory's."""
        got = self.xy_memo.get((gc, gy, gx, b, full, "xy"))
        if got is not None and gy > 1 and gx > 1:
            other = self.xy_memo.get((gc, gx, gy, b, full, "yx"))
            got = None if other is None else min(got, other)
        return got or 0.0

    def _kv_floor(self, q: int, gc: int, gy: int, gx: int, b: int, full: bool) -> float:
        """One block's context K/V collectives per micro-batch
        (:func:`tetrad.plan.comm.layers.context_kv`), the least over ``G_z`` dividing ``q``
        (the context group's stride is ``G_x G_y G_z``), seconds."""
        key = (q, gc, gy, gx, b, full)
        got = self.kv_memo.get(key)
        if got is None:
            got = min(self._kv_seconds(gc, gz, gy, gx, b, full) for gz in divisors_of(q))
            self.kv_memo[key] = got
        return got

    def _kv_seconds(self, gc: int, gz: int, gy: int, gx: int, b: int, full: bool) -> float:
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
            gather = pieces_exposed_seconds(link.time(ALL_GATHER, payload), comp.attention / k, k)
            scatter = link.time(REDUCE_SCATTER, payload)
            scatter = pieces_exposed_seconds(scatter, comp.attention_bwd / k, k)
            got = (2 * gather if full else gather) + scatter
            self.kv_link_memo[key] = got
        return got

    def _xy_seconds(self, grid, b: int, mode: str, turn: str) -> float:
        """One block's exposed X/Y collectives per micro-batch on ``grid`` in ``turn``
        (:func:`tetrad.plan.pipe.estimate.block_xy`), seconds (memoised per shape)."""
        key = (grid[1], grid[3], grid[4], b, mode == "full", turn)
        got = self.xy_memo.get(key)
        if got is None:
            got = self.xy_memo[key] = sum(block_xy(self.ctx, grid, b, mode, turn)[0].values())
        return got


def _bound(terms: tuple, extra: float, z: float = 0.0) -> float:
    """:meth:`GroupBounds._group_bound` from its ``terms``."""
    bf, model, per_rank, k, block, one = terms
    return bf * (max(model + per_rank * extra, k * (block + extra) + z) + one)
