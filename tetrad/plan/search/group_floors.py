"""Floors of the 5D search's groups (:class:`GroupFloors`, which
:meth:`tetrad.plan.search.four_d.Search4D.rank` asks): seconds that every configuration of a
(grid, orientation, optimizer variant) group takes at least, from its compute per sample
(memoised per shape and micro-batch) and
:meth:`tetrad.plan.search.step_bounds.StepBounds.group_floor`; and a floor of every group of a
tensor/context shape ``(G_context, G_y, G_x)`` of the roles, before its memory is modelled
(:meth:`GroupFloors.shape_floor`).

Where the machine's GEMM efficiency does not fall as the FLOPs grow, a block's seconds per
sample do not grow with the micro-batch ``b`` (its GEMMs' FLOPs, attention and element-wise
work are linear in ``b``): the largest micro-batch's are the least (:meth:`GroupFloors.
monotone_gemm`)."""

from __future__ import annotations

from tetrad.plan.question import StepQuestion
from tetrad.plan.search.space import divisors_of
from tetrad.spec.grid import role_sizes


class GroupFloors:
    """The group floors of one 4D search, memoised.

    Args:
        ctx: the question (:class:`~tetrad.plan.question.StepQuestion`).
        allowed: the micro-batches allowed (None: every divisor).
    """

    def __init__(self, ctx: StepQuestion, allowed: set | None = None):
        self.ctx, self.allowed = ctx, allowed
        self.class_memo: dict = {}  # (G_context, G_y, G_x, B / (G_data G_z), full, sizes)
        self.monotone: bool | None = None  # the GEMM table never falls (monotone_gemm)
        self.per_sample_memo: dict = {}  # (G_context, G_y, G_x, b) -> seconds (per_sample)

    def group_floor(self, bounds, grid, turn: str, zero: bool, classes: dict) -> float:
        """A floor of the steps of ``grid``'s configurations in orientation ``turn`` and
        optimizer variant ``zero`` whose micro-batches are, per ``full`` (whether the mode is
        ``full``), among ``classes[full]`` (ascending), from the compute per sample
        (:meth:`per_sample`): :meth:`~tetrad.plan.search.step_bounds.StepBounds.group_floor`
        (``bounds``: per variant; None with the axonn model: the least compute of the blocks),
        seconds."""
        roles = role_sizes(grid, turn)
        per_cell = self.ctx.global_batch // (roles[0] * roles[2])
        terms = {
            full: self.class_floor(roles, per_cell, full, sizes) for full, sizes in classes.items()
        }
        if bounds is None:
            return min(t[0] for t in terms.values())
        return bounds[zero].group_floor(grid, turn, terms)

    def shape_floor(self, roles: tuple) -> float:
        """A floor of :meth:`group_floor` over every group whose roles have ``roles``'
        ``(G_context, G_y, G_x)`` (and so the same ``B / (G_data G_z)`` samples per cell on
        the same GPUs), whatever fits: the cell's samples times the least per-sample seconds
        of the blocks' forward and backward over the micro-batches allowed (every group's
        floor is at least its compute, each class's at least this), seconds; ``inf`` where
        no micro-batch is allowed."""
        per_cell = self.ctx.global_batch // (roles[0] * roles[2])
        sizes = [b for b in divisors_of(per_cell) if self.allowed is None or b in self.allowed]
        if not sizes:
            return float("inf")
        if self.monotone_gemm():
            sizes = sizes[-1:]
        return per_cell * min(self.per_sample(roles, b)[0] for b in sizes)

    def class_floor(self, roles: tuple, per_cell: int, full: bool, sizes: list) -> tuple:
        """``(compute, slack, largest)`` of :meth:`~tetrad.plan.search.step_bounds.StepBounds.
        group_floor` for the micro-batches ``sizes`` (ascending) of a ``G_data G_z`` cell of
        ``per_cell`` samples: ``per_cell`` times the least per-sample seconds (``acc = per_cell
        / b`` micro-batches of ``b`` samples); memoised per ``(G_context, G_y, G_x)``, cell,
        class and micro-batches (the largest alone where :meth:`monotone_gemm`: its per-sample
        seconds are the least)."""
        monotone = self.monotone_gemm()
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
                blocks, blocks_full, tail = self.per_sample(roles, b)
                compute = min(compute, blocks_full if full else blocks)
                slack = min(slack, tail)
            got = self.class_memo[key] = (per_cell * compute, per_cell * slack, sizes[-1])
        return got

    def monotone_gemm(self) -> bool:
        """Whether the machine's GEMM efficiency table (and its FP8 one, with FP8) never falls
        as the FLOPs grow (memoised)."""
        if self.monotone is None:
            machine = self.ctx.machine
            tables = [machine.gemm_table]
            if self.ctx.fp8 != "off":
                tables.append(machine.fp8_gemm_table)
            self.monotone = all(
                a[1] <= b[1] for t in tables for a, b in zip(t, t[1:], strict=False)
            )
        return self.monotone

    def per_sample(self, roles: tuple, b: int) -> tuple[float, float, float]:
        """Per sample of a micro-batch of ``b`` on the roles' ``(G_context, G_y, G_x)``: the
        blocks' forward and backward, the same with a recomputed forward, and ``t_final_norm -
        t_post / 2`` (:meth:`~tetrad.plan.search.step_bounds.StepBounds.group_floor`), seconds
        (memoised)."""
        key = (roles[1], roles[3], roles[4], b)
        got = self.per_sample_memo.get(key)
        if got is None:
            comp, L = self.ctx.compute(roles, b), self.ctx.model.n_layers
            fwd, bwd = comp.block_fwd, comp.block_bwd
            tail = comp.final_norm_fwd - 0.5 * comp.post_fwd[-1]
            got = (L * (fwd + bwd) / b, L * (2 * fwd + bwd) / b, tail / b)
            self.per_sample_memo[key] = got
        return got
