"""Bounds 1 and 2 of the pipeline search (:class:`GroupBounds`, a part of
:class:`tetrad.plan.search.pipeline.pipe_search.PipeSearch`, whose module doc states them): the tensor
shapes ``(G_context, G_y, G_x, mode)`` and the groups ``(G_pipe, G_context, G_y, G_x, b,
mode)`` on them, and what rejects a whole group, or a grid of it, before its schedules are
enumerated (:meth:`GroupBounds._group_grids`):

- its context K/V collectives, the least over ``G_z`` (cheap: two link times per ``G_z``);
- its memory floor (:mod:`tetrad.plan.search.pipeline.memory_floors`), whatever the time: the ``G_z``
  that can fit;
- per ``G_z``, its context collectives and the Z seconds a rank of the most blocks cannot hide
  (:mod:`tetrad.plan.search.pipeline.schedule_floors`);
- per grid, its blocks' exposed X/Y collectives (memoised per shape and orientation).

A rank's per-micro-batch time is at least ``k (c_block + x) + z`` on a rank of the most blocks
``k = ceil(L / p)`` and at least the average ``c_model / p + (L / p) x`` (``x``: a block's
collectives per micro-batch, ``z`` the Z floor; every rank receives at least one
point-to-point message), times ``m``: the slowest rank runs its ``m`` micro-batches one after
another whatever the schedule; the bubble, which on uneven ranks depends on the others
(:mod:`tetrad.plan.pipe.critical_path`), is left to bound 3.
"""

from __future__ import annotations

from tetrad.plan.comm.context_parallel import (
    PIECE_CANDIDATES,
    context_problems,
    kv_gather_payload,
    pieces_exposed_seconds,
)
from tetrad.plan.compute.block import block_compute
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.pipe.pipeline_step import block_xy, split_key, split_ranks
from tetrad.plan.pipe.schedule import p2p_bytes
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.search.space import divisors_of
from tetrad.plan.search.step_bounds import MARGIN

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
        self.kv_phase_memo: dict = {}  # (G_context, G_y, G_x) -> per sample (gather, scatter)
        self.kv_memo: dict = {}  # (G_data G_z, G_context, G_y, G_x, b, full) -> seconds
        self.kv_link_memo: dict = {}  # (G_context, G_x G_y G_z, G_y, b, full) -> seconds
        self.xy_memo: dict = {}  # (G_context, G_y, G_x, b, full, turn) -> seconds
        self.lead_memo: dict = {}  # (split_key, p, v) -> (rho, blocks before it)
        self.least_lead_memo: dict = {}  # (p, p divides m, split ratios) -> (rho, blocks), weighted
        self.pipe_links = {
            p: self.ctx.machine.network.link(self.s.gpus // p, 2) for p in self.pipes
        }

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
        gather, scatter = self._kv_phases(gc, gy, gx)
        return self.ctx.model.n_layers * ((2 if full else 1) * gather + scatter)

    def _kv_phases(self, gc: int, gy: int, gx: int) -> tuple[float, float]:
        """``(gather, scatter)`` of :meth:`_kv_per_sample`: one block's exposed all-gather and
        reduce-scatter per sample at least, seconds (memoised: every mode asks)."""
        got = self.kv_phase_memo.get(key := (gc, gy, gx))
        if got is None:
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
            got = self.kv_phase_memo[key] = (gather, scatter)
        return got

    def _mb_costs(self, gc: int, gy: int, gx: int, b: int, mode: str) -> tuple:
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

    def _most_blocks(self, pipe: int) -> int:
        """The fewest blocks the slowest of ``pipe`` ranks can hold: ``ceil(L / p)``."""
        return -(-self.ctx.model.n_layers // pipe)

    def _bubble_factor(self, pipe: int, m: int) -> float:
        """The micro-batches the slowest rank runs one after another, ``m`` (bound 2; no
        bubble: on uneven ranks it may be below ``(p - 1) / v`` of a rank's time)."""
        return float(m)

    def _pipe_group(self, pipe, gc, gy, gx, mode, per_sample: float, limit: float) -> list:
        """Bound 2 of each micro-batch of ``G_pipe = pipe`` on the roles ``(G_context, G_y,
        G_x)``: ``(bound, pipe, G_data G_z, G_context, G_y, G_x, b, mode)``, those below
        ``limit`` (less MARGIN) only (``m`` times the slowest rank's compute); none where ``B /
        (G_data G_z)`` samples at ``per_sample`` seconds (:meth:`_tensor_groups`) over ``p`` (a
        floor of every group bound) reach ``limit``."""
        out = []
        if (self.s.gpus // pipe) % (gc * gy * gx):
            return out
        q = self.s.gpus // (pipe * gc * gy * gx)  # G_data G_z
        if self.ctx.global_batch % q:
            return out
        per_cell = self.ctx.global_batch // q
        if per_cell * per_sample / pipe * (1 - MARGIN) >= limit:
            return out
        k = self._most_blocks(pipe)
        for b in divisors_of(per_cell):
            if self.allowed is not None and b not in self.allowed:
                continue
            model, block = self._mb_costs(gc, gy, gx, b, mode)[:2]
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
        """``(m, model / p, L / p, k, block, one receive, leads, gpipe)`` of
        :meth:`_group_bound`, seconds (``leads``: :meth:`_least_lead`; ``gpipe``: ``p`` where
        only GPipe runs, ``m < p``, else 0). Not memoised: each group asks once."""
        ctx = self.ctx
        model, block, costs, ratios = self._mb_costs(gc, gy, gx, b, mode)
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.hidden, gc, gx, ctx.c)
        link = self.pipe_links[pipe]
        one = link.base_latency + nbytes / link.bandwidth
        m = ctx.global_batch // (q * b)
        bf = self._bubble_factor(pipe, m)
        L, k = ctx.model.n_layers, self._most_blocks(pipe)
        leads = self._least_lead(pipe, m, costs, one, ratios)
        return bf, model / pipe, L / pipe, k, block, one, leads, pipe if m < pipe else 0

    def _least_lead(self, pipe: int, m: int, costs: tuple, one: float, ratios: tuple):
        """``(lead, mean)``: the least :meth:`_lead_seconds` over the ``v`` the group's schedules
        may take (1, and :data:`VIRTUAL_CHOICES` where ``p`` divides ``m``; ``p v <= L``), and
        the least mean over ranks ``r`` of the same floor for ``r`` (each rank is idle at least
        that long, so the step is at least it plus ``m`` times the mean ``T_r``), seconds
        (``ratios``: the costs' split ratios, :meth:`_mb_costs`)."""
        L = self.ctx.model.n_layers
        # the splits depend on the costs through split_key's rounded ratios only
        key = (pipe, m % pipe == 0, *ratios)
        got = self.least_lead_memo.get(key)
        if got is None:
            vs = [v for v in (1,) + (VIRTUAL_CHOICES if key[1] else ()) if pipe * v <= L]
            splits = [self._lead_split(pipe, v, costs) for v in vs]
            # the splits no other is at or below in both rho and blocks: the least lead's
            pairs = {(r, n) for r, n, _ in splits}
            lowest = [a for a in pairs if all(b == a for b in _pareto(pairs, a))]
            got = self.least_lead_memo[key] = (lowest, min(w for _, _, w in splits))
        lowest, weighted = got
        lead = min(n * costs[0] + costs[1] + (2 * r - 1) * one if r else 0.0 for r, n in lowest)
        p = pipe
        return lead, (weighted * costs[0] + (p - 1) * (costs[1] + (p - 1) * one)) / p

    def _lead_split(self, pipe: int, virtual: int, costs: tuple) -> tuple[int, int, int]:
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

    def _lead_seconds(self, pipe: int, virtual: int, costs: tuple, one: float) -> float:
        """A floor of the path into and out of rank ``rho`` (:meth:`_lead_split`): micro-batch
        0's forward through stages ``0 .. rho - 1`` before its first operation and the last
        micro-batch's backward through them after its last (in GPipe, 1F1B and interleaved 1F1B
        a rank starts with its first stage's first forward and ends with its last backward),
        each stage's compute (its blocks, the embedding on stage 0) and receives (``2 rho -
        1``); the step is at least this plus ``m T_rho`` (:mod:`tetrad.plan.pipe.critical_path`),
        seconds."""
        return _lead(self._lead_split(pipe, virtual, costs), costs, one)

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
            xy = self._known_xy(gc, gy, gx, b, full)
            if _bound(terms, xy) >= cap:
                return []  # the bound grows with the seconds added: the context's later
            if gc > 1 and _bound(terms, self._kv_floor(q, gc, gy, gx, b, full) + xy) >= cap:
                return []
        out = []
        for gz in self._fitting_z(pipe, q, gc, gy, gx, b, mode):
            if not timed:
                out += [(0.0, grid, turn) for grid, turn in self._turns((q // gz, gc, gz, gy, gx))]
                continue
            z = self._z_exposed(pipe, gc, gz, gy, gx, b, full)
            if _bound(terms, 0.0, z) >= cap:
                continue  # the Z floor rejects the most: the context's later
            kv = self._kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
            if _bound(terms, kv, z) >= cap:
                continue
            for grid, turn in self._turns((q // gz, gc, gz, gy, gx)):
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
        (:func:`tetrad.plan.pipe.pipeline_step.block_xy`), seconds (memoised per shape)."""
        key = (grid[1], grid[3], grid[4], b, mode == "full", turn)
        got = self.xy_memo.get(key)
        if got is None:
            got = self.xy_memo[key] = sum(block_xy(self.ctx, grid, b, mode, turn)[0].values())
        return got


def _pareto(pairs, a: tuple) -> list:
    """The pairs at or below ``a`` in both entries."""
    return [b for b in pairs if b[0] <= a[0] and b[1] <= a[1]]


def _lead(split: tuple, costs: tuple, one: float) -> float:
    """:meth:`GroupBounds._lead_seconds` of a :meth:`GroupBounds._lead_split`."""
    rho, blocks, _ = split
    return blocks * costs[0] + costs[1] + (2 * rho - 1) * one if rho else 0.0


def _bound(terms: tuple, extra: float, z: float = 0.0) -> float:
    """:meth:`GroupBounds._group_bound` from its ``terms``: ``m`` times the average rank plus
    the ranks' mean idle floor, or ``m`` times a rank of the most blocks plus the path into and
    out of it; where only GPipe runs (``m < p``), also its ``sum_r T_r + (m - 1) max_r T_r``
    (:func:`tetrad.plan.pipe.critical_path.schedule_step`, at least ``sum_s (f_s + b_s)`` for
    one micro-batch and ``max_s f_s + max_s b_s`` for each further one)."""
    bf, model, per_rank, k, block, one, (lead, mean_lead), gpipe = terms
    avg = model + per_rank * extra + one
    most = k * (block + extra) + z + one
    out = max(bf * avg + mean_lead, bf * most + lead)
    if gpipe:
        out = max(out, gpipe * avg + (bf - 1) * max(avg, most))
    return out
