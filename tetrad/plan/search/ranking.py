"""The ranking of the 4D search (:class:`Ranking`, a part of
:class:`tetrad.plan.search.four_d._Search4D`): the groups of configurations of the 5D space
best first (:func:`tetrad.plan.search.top.best_first`), then, with the pipeline axis, the
pipeline search (:class:`tetrad.plan.search.pipeline.pipe_search.PipeSearch`) against the bar they set
(its bounds are looser: visited first, with no bar yet, it times more).

A 5D group is a grid, an orientation and an optimizer variant; its floor
(:meth:`Ranking._group_floor`, :meth:`tetrad.plan.search.step_bounds.StepBounds.group_floor`) needs
what fits (the memory lines) and the compute per sample, not its configurations, which are
built (:meth:`tetrad.plan.search.memory_fits.Candidates.expand`) only when the group is visited.
Each configuration then passes through the same queue at its bounds, cheapest first
(:class:`~tetrad.plan.search.step_bounds.StepBounds`: the cheap bound, then with the X/Y and context
collectives), and is timed when its last bound comes up. Ties in step time go to the earlier
enumerated configuration (:mod:`tetrad.plan.search.top`), so the order of the visits changes no
answer.
"""

from __future__ import annotations

import heapq
import itertools

from tetrad.plan.question import sharded
from tetrad.plan.search.step_bounds import MARGIN, StepBounds
from tetrad.plan.search.top import PIPELINE_SEQ, best_first, offer, slowest
from tetrad.spec import role_sizes

MAY_FIT, FITS, CHEAP, TIME = 0, 1, 2, 3
"""Kinds of the queue's entries: a 5D group at the floor of what may fit, of what fits; one of
its configurations at its cheap bound, at its bound with the X/Y collectives (then timed)."""


class Ranking:
    """Best-first ranking; ``self.ctx``, ``self.stats``, ``self.comm_model``, the memory and
    configurations of :class:`~tetrad.plan.search.memory_fits.Candidates`, ``self._time``,
    ``self.per_sample``, ``self.class_memo`` and ``self.monotone`` come from the search."""

    def rank(self, groups: list, top: int, pipes=None) -> list:
        """The ``top`` fastest configurations of the 5D groups (:meth:`candidates`: ``(grid,
        orientation)``) and, with ``pipes`` (a
        :class:`~tetrad.plan.search.pipeline.pipe_search.PipeSearch`), of the pipeline search, as the heap
        of :mod:`tetrad.plan.search.top` (items ``(grid, b, ckpt, orientation, estimate)``; a
        pipeline's estimate is its ``(PipeEstimate, PipeConfig, memory, sharded)``).

        Each group's optimizer variants enter the queue at a floor from what may fit
        (:meth:`~tetrad.plan.search.memory_fits.Candidates.may_fit`); visited, the group's
        memory lines are built (:meth:`~tetrad.plan.search.memory_fits.Candidates.oriented_fits`,
        counted in the statistics) and the variant enters again at the floor of what fits;
        visited again, its configurations enter at their cheap bounds (:meth:`_visit_group`),
        then at their bounds with the X/Y collectives, and are timed when the queue reaches
        them (:meth:`_visit_config`): the first timed are those with the lowest bounds, so the
        bar is near its last value after the first ``top``."""
        bounds = None
        if self.comm_model == "tetrad":
            plain = StepBounds(self.ctx)
            bounds = {False: plain, True: StepBounds(sharded(self.ctx), like=plain)}
        queue = []
        for gi, (grid, turn) in enumerate(groups):
            for zero, classes in self.may_fit(role_sizes(grid, turn)).items():
                floor = self._group_floor(bounds, grid, turn, zero, classes)
                queue.append((floor, MAY_FIT, len(queue), (gi, zero)))
        heapq.heapify(queue)
        best: list = []
        fits: dict = {}  # group -> its RoleFits
        numbers = itertools.count(len(queue))

        def push(bound: float, kind: int, payload: tuple) -> None:
            heapq.heappush(queue, (bound, kind, next(numbers), payload))

        def visit(kind: int, payload) -> None:
            if kind >= CHEAP:
                self._visit_config(best, top, bounds, push, kind, payload)
                return
            gi, zero = payload
            grid, turn = groups[gi]
            got = fits.get(gi)
            if got is None:
                got = fits[gi] = self.oriented_fits(grid, turn, self.modes, self.allowed)
            if kind == FITS:
                self._visit_group(best, top, bounds, push, gi, grid, turn, got, zero)
            elif zero in got.variants():
                push(self._group_floor(bounds, grid, turn, zero, got.classes(zero)), FITS, payload)

        best_first(queue, best, top, visit, MARGIN)
        self.stats["memory_groups"] = len(fits)
        if pipes is not None:
            pipes.extend(best, top, PIPELINE_SEQ)
        self.stats["pruned"] = self.stats["fitting"] - self.stats["evaluated"]
        return best

    def _visit_group(self, best: list, top: int, bounds, push, gi: int, grid, turn, fits, zero):
        """Queue the configurations of group ``gi`` (``grid`` in orientation ``turn``, what
        fits ``fits``) in variant ``zero`` that may enter ``best``, at their cheap bound (at
        their compute with the axonn model, ``bounds`` None)."""
        keep, limit = 1.0 - MARGIN, slowest(best, top)
        # enumeration order; expand's index < 2^20: at most 3 modes times the divisors of B
        base = (gi << 21) | (int(zero) << 20)
        for lb, index, b, ckpt in self.expand(role_sizes(grid, turn), fits, zero):
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
        context collectives (:meth:`~tetrad.plan.search.step_bounds.StepBounds.with_xy`), queued where
        it may enter ``best``; from that to its estimate, timed into ``best``."""
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
        """A floor of the steps of ``grid``'s configurations in orientation ``turn`` and
        optimizer variant ``zero`` whose micro-batches are, per ``full`` (whether the mode is
        ``full``), among ``classes[full]`` (ascending), from the compute per sample
        (:meth:`_per_sample`): :meth:`~tetrad.plan.search.step_bounds.StepBounds.group_floor`
        (``bounds``: per variant; None with the axonn model: the least compute of the blocks),
        seconds."""
        roles = role_sizes(grid, turn)
        per_cell = self.ctx.global_batch // (roles[0] * roles[2])
        terms = {
            full: self._class_floor(roles, per_cell, full, sizes) for full, sizes in classes.items()
        }
        if bounds is None:
            return min(t[0] for t in terms.values())
        return bounds[zero].group_floor(grid, turn, terms)

    def _class_floor(self, roles: tuple, per_cell: int, full: bool, sizes: list) -> tuple:
        """``(compute, slack, largest)`` of :meth:`~tetrad.plan.search.step_bounds.StepBounds.
        group_floor` for the micro-batches ``sizes`` (ascending) of a ``G_data G_z`` cell of
        ``per_cell`` samples: ``per_cell`` times the least per-sample seconds (``acc = per_cell
        / b`` micro-batches of ``b`` samples); memoised per ``(G_context, G_y, G_x)``, cell,
        class and micro-batches. Where the machine's GEMM efficiency does not fall with the
        FLOPs, a block's seconds per sample do not grow with ``b`` (its GEMMs' FLOPs, attention
        and element-wise work are linear in ``b``): the largest micro-batch's are the least."""
        monotone = self._monotone_gemm()
        key = (
            roles[1],
            roles[3],
            roles[4],
            per_cell,
            full,
            sizes[-1] if monotone else tuple(sizes),
        )
        got = self.class_memo.get(key)
        if got is None:
            compute, slack = float("inf"), float("inf")
            for b in sizes[-1:] if monotone else sizes:
                blocks, blocks_full, tail = self._per_sample(roles, b)
                compute = min(compute, blocks_full if full else blocks)
                slack = min(slack, tail)
            got = self.class_memo[key] = (per_cell * compute, per_cell * slack, sizes[-1])
        return got

    def _monotone_gemm(self) -> bool:
        """Whether the machine's GEMM efficiency table never falls as the FLOPs grow
        (memoised)."""
        if self.monotone is None:
            table = self.ctx.machine.gemm_table
            self.monotone = all(a[1] <= b[1] for a, b in zip(table, table[1:], strict=False))
        return self.monotone

    def _per_sample(self, roles: tuple, b: int) -> tuple[float, float, float]:
        """Per sample of a micro-batch of ``b`` on the roles' ``(G_context, G_y, G_x)``: the
        blocks' forward and backward, the same with a recomputed forward, and ``t_final_norm -
        t_post / 2`` (:meth:`~tetrad.plan.search.step_bounds.StepBounds.group_floor`), seconds
        (memoised)."""
        key = (roles[1], roles[3], roles[4], b)
        got = self.per_sample.get(key)
        if got is None:
            comp, L = self.ctx.compute(roles, b), self.ctx.model.n_layers
            fwd, bwd = comp.block_fwd, comp.block_bwd
            tail = comp.final_norm_fwd - 0.5 * comp.post_fwd[-1]
            got = self.per_sample[key] = (L * (fwd + bwd) / b, L * (2 * fwd + bwd) / b, tail / b)
        return got
