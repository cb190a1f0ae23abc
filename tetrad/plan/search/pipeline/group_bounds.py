"""Bounds 1 and 2 of the pipeline search (:class:`GroupBounds`; the package doc,
:mod:`tetrad.plan.search.pipeline`, states them): the tensor shapes ``(G_context, G_y, G_x,
mode)`` and the groups ``(G_pipe, G_context, G_y, G_x, b, mode)`` on them, and what rejects a
whole group, or a grid of it, before its schedules are enumerated (:meth:`GroupBounds.grids`):

- its context K/V collectives, the least over ``G_z`` (cheap: two link times per ``G_z``);
- its memory floor (:mod:`tetrad.plan.search.pipeline.memory_floors`), whatever the time: the
  ``G_z`` that can fit;
- per ``G_z``, its context collectives and the Z seconds a rank of the most blocks cannot hide
  (:mod:`tetrad.plan.search.pipeline.floor_terms`);
- per grid, its blocks' exposed X/Y collectives (memoised per shape and orientation).

A rank's per-micro-batch time is at least ``k (c_block + x) + z`` on a rank of the most blocks
``k = ceil(L / p)`` and at least the average ``c_model / p + (L / p) x`` (``x``: a block's
collectives per micro-batch, ``z`` the Z floor; every rank receives at least one
point-to-point message), times ``m``: the slowest rank runs its ``m`` micro-batches one after
another whatever the schedule; the bubble, which on uneven ranks depends on the others
(:mod:`tetrad.plan.pipe.critical_path`), is left to bound 3.
"""

from __future__ import annotations

from collections.abc import Callable

from tetrad.plan.compute.block import block_compute
from tetrad.plan.pipe.schedule import p2p_bytes
from tetrad.plan.question import StepQuestion
from tetrad.plan.search.pipeline.configs import pipe_sizes
from tetrad.plan.search.pipeline.floor_terms import FloorTerms
from tetrad.plan.search.pipeline.memory_floors import MemoryFloors
from tetrad.plan.search.space import divisors_of
from tetrad.plan.search.step_bounds import MARGIN
from tetrad.spec.sharding import context_problems, grid_problems


class GroupBounds:
    """Bounds 1 and 2 and the group tests of the module doc.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        gpus: GPUs of every pipeline grid.
        modes: the checkpointing modes tried, in :data:`~tetrad.plan.search.pipeline.configs.
            MODE_ORDER`.
        allowed: the micro-batches allowed (None: every divisor).
        terms: the floors' memoised terms.
        memory: the memory floors (the ``G_z`` whose floor fits).
        turns: ``roles -> ((--grid, orientation), ...)``, the grids of a role assignment the
            search tries.
    """

    def __init__(
        self,
        ctx: StepQuestion,
        gpus: int,
        modes: tuple[str, ...],
        allowed: set | None,
        terms: FloorTerms,
        memory: MemoryFloors,
        turns: Callable[[tuple], tuple],
    ):
        self.ctx, self.gpus, self.modes, self.allowed = ctx, gpus, modes, allowed
        self.terms, self.memory, self.turns = terms, memory, turns
        self.pipes = pipe_sizes(gpus, ctx.model.n_layers)  # the G_pipe tried
        self._monotone: bool | None = None

    def _per_sample_floors(self, gc: int, gy: int, gx: int) -> dict[str, float]:
        """Bound 1 per sample of one ``(G_context, G_y, G_x)`` rank, per mode: the blocks'
        compute of one sample with every GEMM at the machine's best efficiency (FP8 GEMMs at
        the best of the FP8 table)."""
        ctx = self.ctx
        best = max(e for _, e in ctx.machine.gemm_table)
        best8 = max((e for _, e in ctx.machine.fp8_gemm_table), default=1.0)
        comp = block_compute(
            ctx.model,
            ctx.machine,
            (1, gc, 1, gy, gx),
            1,
            ctx.seq_len,
            linears=ctx.linears,
            gemm_efficiency=lambda f: best,
            fp8=ctx.fp8,
            fp8_efficiency=lambda f: best8,
            fp8_casts=False,
            sequence_split=ctx.sequence_split(gc, gy, gx),
        )
        rec = {"full": comp.block_fwd, "selective": comp.selective, "none": 0.0}
        base = comp.block_fwd + comp.block_bwd
        return {m: ctx.model.n_layers * (base + rec[m]) for m in self.modes}

    def shapes(self) -> list:
        """``(bound 1, G_context, G_y, G_x, mode, per sample, with context)`` of every
        tensor/context shape (the roles' sizes) that shards the model; ``per sample``: bound 1's
        seconds per sample with the blocks' context collectives (:meth:`FloorTerms.kv_per_sample`);
        ``with context``: bound 1 with them."""
        ctx, gpus, model = self.ctx, self.gpus, self.ctx.model
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
                        kv = floor + self.terms.kv_per_sample(gc, gy, gx, mode == "full")
                        out.append((share * floor, gc, gy, gx, mode, kv, share * kv))
        out.sort(key=lambda t: t[0])
        return out

    def _bubble_factor(self, pipe: int, m: int) -> float:
        """The micro-batches the slowest rank runs one after another, ``m`` (bound 2; no
        bubble: on uneven ranks it may be below ``(p - 1) / v`` of a rank's time)."""
        return float(m)

    def groups(self, pipe, gc, gy, gx, mode, per_sample: float, limit: float) -> list:
        """Bound 2 of each micro-batch of ``G_pipe = pipe`` on the roles ``(G_context, G_y,
        G_x)``: ``(bound, pipe, G_data G_z, G_context, G_y, G_x, b, mode)``, those below
        ``limit`` (less MARGIN) only (``m`` times the slowest rank's compute); none where ``B /
        (G_data G_z)`` samples at ``per_sample`` seconds (:meth:`shapes`) over ``p`` (a
        floor of every group bound) reach ``limit``."""
        q, sizes = self.micro_batches(pipe, gc, gy, gx, per_sample, limit)
        out = []
        for b in sizes:
            group = self.group(pipe, q, gc, gy, gx, b, mode)
            if group[0] * (1 - MARGIN) < limit:
                out.append(group)
        return out

    def micro_batches(self, pipe, gc, gy, gx, per_sample: float, limit: float) -> tuple:
        """``(G_data G_z, micro-batches)`` of the groups of ``G_pipe = pipe`` on the roles
        ``(G_context, G_y, G_x)`` (ascending; none where the pipeline does not split the
        grid, the batch does not split over ``G_data G_z``, or :meth:`groups`' floor of every
        group bound reaches ``limit``)."""
        if (self.gpus // pipe) % (gc * gy * gx):
            return 0, ()
        q = self.gpus // (pipe * gc * gy * gx)  # G_data G_z
        if self.ctx.global_batch % q:
            return q, ()
        per_cell = self.ctx.global_batch // q
        if per_cell * per_sample / pipe * (1 - MARGIN) >= limit:
            return q, ()
        sizes = divisors_of(per_cell)
        if self.allowed is not None:
            sizes = [b for b in sizes if b in self.allowed]
        return q, sizes

    def group(self, pipe, q, gc, gy, gx, b, mode) -> tuple:
        """``(bound 2, pipe, q, G_context, G_y, G_x, b, mode)`` of one group: ``m`` times the
        slowest rank's compute, at least the whole model's over ``p`` and ``ceil(L / p)``
        blocks'. Where the GEMM efficiency never falls with the FLOPs (:meth:`monotone`) it
        does not grow with ``b``: a block's and the model's seconds per sample do not."""
        model, block = self.terms.micro_batch_costs(gc, gy, gx, b, mode)[:2]
        per_cell = self.ctx.global_batch // q
        lb = self._bubble_factor(pipe, per_cell // b) * max(
            model / pipe, self.terms.most_blocks(pipe) * block
        )
        return (lb, pipe, q, gc, gy, gx, b, mode)

    def monotone(self) -> bool:
        """Whether the machine's GEMM efficiency tables (the FP8 one too, with FP8) never fall
        as the FLOPs grow (memoised)."""
        if self._monotone is None:
            machine = self.ctx.machine
            tables = [machine.gemm_table]
            if self.ctx.fp8 != "off":
                tables.append(machine.fp8_gemm_table)
            self._monotone = all(
                a[1] <= b[1] for t in tables for a, b in zip(t, t[1:], strict=False)
            )
        return self._monotone

    def group_bound(self, pipe, q, gc, gy, gx, b, mode, extra: float, z: float = 0.0) -> float:
        """Bound 2 with ``extra`` seconds per block and micro-batch on every block, ``z``
        exposed Z seconds per micro-batch on a rank of the most blocks, and one point-to-point
        receive per rank (module doc)."""
        return _bound(self.bound_terms(pipe, q, gc, gy, gx, b, mode), extra, z)

    def bound_terms(self, pipe, q, gc, gy, gx, b, mode) -> tuple:
        """``(m, model / p, L / p, k, block, one receive, leads, gpipe)`` of :meth:`group_bound`,
        seconds (``leads``: :meth:`FloorTerms.least_lead`; ``gpipe``: ``p`` where only GPipe runs,
        ``m < p``, else 0). Not memoised: each group asks once."""
        ctx = self.ctx
        model, block, costs, ratios = self.terms.micro_batch_costs(gc, gy, gx, b, mode)
        split = ctx.sequence_split(gc, gy, gx)
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.dim, gc, gx, ctx.c, split)
        link = self.terms.pipe_links[pipe]
        one = link.base_latency + nbytes / link.bandwidth
        m = ctx.global_batch // (q * b)
        bf = self._bubble_factor(pipe, m)
        L, k = ctx.model.n_layers, self.terms.most_blocks(pipe)
        leads = self.terms.least_lead(pipe, m, costs, one, ratios)
        return bf, model / pipe, L / pipe, k, block, one, leads, pipe if m < pipe else 0

    def refined(self, pipe, q, gc, gy, gx, b, mode) -> tuple[float, tuple]:
        """``(bound, terms)``: the group's bound with its context collectives at their least
        over ``G_z`` and the X/Y seconds known so far (:meth:`FloorTerms.known_xy`), the first
        test of :meth:`grids`, and its :meth:`bound_terms` (for :meth:`grids`), seconds."""
        full, terms = mode == "full", self.bound_terms(pipe, q, gc, gy, gx, b, mode)
        extra = self.terms.known_xy(gc, gy, gx, b, full)
        if gc > 1:
            extra += self.terms.kv_floor(q, gc, gy, gx, b, full)
        return _bound(terms, extra), terms

    def grids(self, pipe, q, gc, gy, gx, b, mode, limit: float, terms=None) -> list:
        """``(bound, --grid, orientation)`` of the group's grids whose memory floor fits and whose
        bound is below ``limit`` seconds (less MARGIN; ``inf``: every grid that fits, bound 0), in
        ascending ``G_z`` and orientation order. Cheapest first: the context collectives at their
        least over ``G_z``, the memory floor (the ``G_z`` it leaves), per ``G_z`` the context and Z
        floors (:meth:`FloorTerms.z_exposed`), then per orientation the X/Y collectives
        (:meth:`FloorTerms.xy_seconds`); ``terms``: the group's :meth:`bound_terms` where
        known."""
        full, timed = mode == "full", limit < float("inf")
        if timed and terms is None:
            terms = self.bound_terms(pipe, q, gc, gy, gx, b, mode)
        cap = limit / (1 - MARGIN)  # a bound at or above it prunes
        if timed:
            xy = self.terms.known_xy(gc, gy, gx, b, full)
            if _bound(terms, xy) >= cap:
                return []  # the bound grows with the seconds added: the context's later
            if gc > 1 and _bound(terms, self.terms.kv_floor(q, gc, gy, gx, b, full) + xy) >= cap:
                return []
        out = []
        for gz in self.memory.fitting_z(pipe, q, gc, gy, gx, b, mode):
            if not timed:
                out += [(0.0, grid, turn) for grid, turn in self.turns((q // gz, gc, gz, gy, gx))]
                continue
            z = self.terms.z_exposed(pipe, gc, gz, gy, gx, b, full)
            if _bound(terms, 0.0, z) >= cap:
                continue  # the Z floor rejects the most: the context's later
            kv = self.terms.kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
            if _bound(terms, kv, z) >= cap:
                continue
            for grid, turn in self.turns((q // gz, gc, gz, gy, gx)):
                bound = _bound(terms, kv + self.terms.xy_seconds(grid, b, mode, turn), z)
                if bound < cap:
                    out.append((bound, grid, turn))
        return out


def _bound(terms: tuple, extra: float, z: float = 0.0) -> float:
    """:meth:`GroupBounds.group_bound` from its ``terms``: ``m`` times the average rank plus
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
