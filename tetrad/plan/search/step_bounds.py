"""Lower bounds of a configuration's step time, for the search's pruning: cheap, never above
:func:`tetrad.plan.step_time.estimate`'s ``step_s``, and tight enough that most
configurations need no estimate.

A step is compute plus exposed communication (:mod:`tetrad.plan.step_time`). Every exposed
term is at least 0, so any subset of them added to the compute bounds the step from below.
:class:`StepBounds` gives two, the second tighter and dearer:

- :meth:`~StepBounds.cheap`, from memoised terms: per grid the optimizer, the step-level
  scalars and the data-parallel gradient all-reduce (blocking, or its buckets' seconds, which
  :func:`tetrad.plan.comm.layers.bucket_exposed` turns into exposed seconds given the
  compute they hide behind); per ``(G_z, G_y, G_x)`` the embedding tables' Z collectives of a
  micro-batch (:func:`tetrad.plan.comm.zwindows.table_seconds`: the reduce-scatters wait
  after all compute, the all-gathers block but where the step's previous micro-batch
  prefetched them) and the Z weights' queue with the prefetched tables', of which a step
  exposes at least what its compute windows cannot hold
  (:func:`tetrad.plan.comm.zwindows.z_queue_seconds`);
- :meth:`~StepBounds.with_xy`: the context K/V collectives and every X and Y collective,
  one micro-batch's memoised per ``(G_context, G_y, G_x)`` (and ``G_z`` for K/V),
  micro-batch and recompute, times the micro-batches
  (:func:`tetrad.plan.step_time.xy_record`).

And a floor of :meth:`~StepBounds.cheap` over a whole group of configurations of one grid,
before their compute is known (:meth:`~StepBounds.group_floor`), for the best-first search's
queue (:meth:`tetrad.plan.search.four_d.Search4D.rank`).

The search compares a bound with the slowest of its best configurations so far only after
shrinking it by :data:`MARGIN`, so rounding (the bound adds its terms in another order than the
estimate) can never drop a configuration that belongs to the ranking.
"""

from __future__ import annotations

from tetrad.plan.comm import layers
from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.comm.zwindows import table_seconds, window_seconds, z_queue_seconds
from tetrad.plan.compute.elementwise import optimizer_seconds
from tetrad.plan.machine.network import ALL_REDUCE, REDUCE_SCATTER
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import make_step, xy_record
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.grid import role_sizes

MARGIN = 1e-9
"""Relative amount a bound is shrunk by before it prunes (far above the rounding of its sums,
far below any difference between configurations that matters)."""


class StepBounds:
    """Lower bounds of the step seconds of one planner question's configurations.

    Args:
        ctx: the question (model, machine, batch, overlaps).
        like: the bounds of the same question with the optimizer sharded otherwise, whose Z,
            X/Y and context K/V terms (the same whatever the optimizer) these share.
    """

    def __init__(self, ctx: StepQuestion, like: StepBounds | None = None):
        self.ctx = ctx
        self._grid: dict = {}  # grid -> (optimizer + scalars seconds, data-parallel terms)
        self._cheap: dict = {}  # (grid, orientation, b, full) -> the terms :meth:`cheap` adds
        # terms that do not depend on the optimizer's sharding: shared with ``like``'s
        self._z: dict = like._z if like else {}  # (G_z, G_y, G_x, full) -> Z seconds
        self._xy: dict = like._xy if like else {}  # (G_context, G_y, G_x, b, full, turn)
        self._kv: dict = like._kv if like else {}  # (G_context, G_z, G_y, G_x, b, full)

    def _grid_terms(self, st: Step, grid: tuple) -> tuple[float, tuple[float, ...]]:
        """Per grid: the optimizer and the step-level scalars, seconds per step; and the
        data-parallel all-reduce: ``()`` (none), ``(seconds,)`` (blocking) or the buckets'
        seconds of a block, the LM head and the embedding (``dp_all_reduce``)."""
        got = self._grid.get(grid)
        if got is None:
            local = st.n_layers * st.block_el + st.head_el + st.emb_el + st.vector_el
            optimizer = optimizer_seconds(
                local, self.ctx.machine.hbm_bytes_per_s, st.optimizer_shards, st.param_bytes
            )
            rec = Recorder(False)
            layers.step_scalars(rec, st)
            if st.sizes["data"] == 1:
                data: tuple[float, ...] = ()
            elif st.dp_overlap:
                data = layers.bucket_seconds(st)
            else:
                kind = REDUCE_SCATTER if st.zero else ALL_REDUCE
                data = (st.links["data"].time(kind, layers.gradient_bytes(st)),)
            got = self._grid[grid] = (optimizer + sum(rec.exposed.values()), data)
        return got

    def _z_terms(self, st: Step) -> tuple[float, float, float]:
        """Per ``(G_z, G_y, G_x)`` and recompute: the embedding tables' Z all-gathers and
        reduce-scatters and the Z weights' queue, seconds per micro-batch."""
        key = (st.sizes["z"], st.sizes["y"], st.sizes["x"], st.checkpointing)
        got = self._z.get(key)
        if got is None:
            tables = table_seconds(st) if st.sizes["z"] > 1 else []
            gather = sum(t[1] for t in tables)
            scatter = sum(t[2] for t in tables)
            got = self._z[key] = (gather, scatter, z_queue_seconds(st))
        return got

    def cheap(
        self,
        grid: tuple,
        micro_batch: int,
        checkpointing: str,
        compute_s: float,
        orientation: str = "xy",
    ) -> float:
        """The compute ``compute_s`` (all micro-batches of the ``--grid`` ``grid = (G_data,
        G_context, G_z, G_y, G_x)`` in ``orientation``, no optimizer) plus the memoised terms of
        the module doc, seconds.

        Raises:
            PlanError: the global batch does not split into micro-batches on this grid.
        """
        full = parse_checkpointing(checkpointing) == "full"
        key = (grid, orientation, micro_batch, full)
        got = self._cheap.get(key)
        if got is None:
            got = self._cheap[key] = self._cheap_terms(*key, checkpointing)
        step_terms, data, z = got
        return compute_s + step_terms + data + z  # added in the order they always were

    def _cheap_terms(
        self, grid: tuple, orientation: str, micro_batch: int, full: bool, checkpointing: str
    ) -> tuple[float, float, float]:
        """The terms :meth:`cheap` adds to the compute, seconds: the optimizer and scalars, the
        data-parallel all-reduce's exposed seconds and the embedding tables' and Z weights'
        floor of all micro-batches (the same for every mode with the same ``full``; memoised by
        the caller)."""
        ctx = self.ctx
        roles = role_sizes(grid, orientation)
        z, terms = self._z.get((*roles[2:], full)), self._grid.get((grid, orientation))
        if z is None or terms is None:
            st = make_step(ctx, grid, micro_batch, checkpointing, orientation)
            terms, z = self._grid_terms(st, (grid, orientation)), self._z_terms(st)
        step_terms, data = terms
        gather, scatter, queue = z
        comp, L = ctx.compute(roles, micro_batch), ctx.model.n_layers
        if len(data) == 3:  # buckets behind a block's backward (and recompute)
            slack = comp.block_bwd + (comp.block_fwd if full else 0.0)
            data = (layers.bucket_exposed(*data, slack, L),)
        acc = ctx.global_batch // (grid[0] * grid[2] * micro_batch)
        # the tables' reduce-scatters wait after all compute; their all-gathers block unless
        # the previous micro-batch of the step prefetched them (then they join the queue)
        blocking = 1 if "prefetch" in ctx.overlaps and acc > 1 else acc
        windows = window_seconds(comp, L, full)
        z = acc * scatter + blocking * gather
        z += max(0.0, acc * (queue - windows) + (acc - blocking) * gather)
        return step_terms, sum(data), z

    def group_floor(self, grid: tuple, orientation: str, classes: dict) -> float:
        """A floor of :meth:`cheap` over a group of configurations of the ``--grid`` ``grid`` in
        ``orientation``, seconds, before their compute is known: ``classes`` maps ``full``
        (whether the mode is ``full``) to ``(compute, slack, largest)``, the least over the
        class's configurations of ``acc L (t_fwd (2 if full else 1) + t_bwd)`` (``acc``
        micro-batches of a block's forward and backward, seconds) and of ``acc (t_final_norm -
        t_post / 2)`` (``t_post`` the work after a block's last Linear), and the largest
        micro-batch among them.

        Per class the larger of two floors of compute plus Z (``a`` the micro-batches at the
        largest micro-batch, ``G``, ``R`` and ``Q`` :meth:`cheap`'s table all-gathers,
        reduce-scatters and queue per micro-batch): ``compute + a R + G`` (the tables'
        reduce-scatters run every micro-batch, at least one all-gather blocks) and ``a (G + R +
        Q) + slack`` (:meth:`cheap`'s max is at least its argument, and a micro-batch's
        windows, :func:`tetrad.plan.comm.zwindows.window_seconds`, are its compute less
        ``t_final_norm - t_post / 2``, 0 as :func:`tetrad.plan.compute.block.block_compute`
        counts them: the final norm's forward is half the norm after a block's last Linear;
        kept so that the floor stays one if that changes); the least over the classes. The
        step terms and the data all-reduce, at least 0, are left out: the Z terms need one
        :class:`~tetrad.plan.comm.record.Step` per ``(G_z, G_y, G_x)``, they one per grid."""
        roles = role_sizes(grid, orientation)
        out = float("inf")
        for full, (compute, slack, largest) in classes.items():
            z = self._z.get((*roles[2:], full))
            if z is None:
                mode = "full" if full else "none"
                z = self._z_terms(make_step(self.ctx, grid, largest, mode, orientation))
            gather, scatter, queue = z
            acc = self.ctx.global_batch // (grid[0] * grid[2] * largest)
            exposed = max(
                compute + acc * scatter + gather, acc * (gather + scatter + queue) + slack
            )
            out = min(out, exposed)
        return out

    def with_xy(
        self,
        floor: float,
        grid: tuple,
        micro_batch: int,
        checkpointing: str,
        orientation: str = "xy",
    ) -> float:
        """``floor`` (:meth:`cheap`) plus the context K/V collectives and every X and Y
        collective's exposed seconds, seconds. Each is recorded per call, ``L acc`` calls (or
        ``acc``), and the ``fine`` choice is the least exposed: the sum is ``acc`` times one
        micro-batch's, memoised per ``(G_context, G_y, G_x)`` (and ``G_z``, the context link's
        stride, for K/V), micro-batch, recompute and orientation (the estimate's own record,
        :func:`xy_record`, is memoised with ``acc``)."""
        full = parse_checkpointing(checkpointing) == "full"
        _, gc, gz, gy, gx = role_sizes(grid, orientation)
        xy_key = (gc, gy, gx, micro_batch, full, orientation)
        kv_key = (gc, gz, gy, gx, micro_batch, full)  # the context link's stride holds G_z
        xy, kv = self._xy.get(xy_key), self._kv.get(kv_key, 0.0 if gc == 1 else None)
        if xy is None or kv is None:
            st = make_step(self.ctx, grid, micro_batch, checkpointing, orientation)
            if xy is None:
                exposed = xy_record(self.ctx, st).exposed.values()
                xy = self._xy[xy_key] = sum(exposed) / st.acc
            if kv is None:
                rec = Recorder(False)
                layers.context_kv(rec, st)
                kv = self._kv[kv_key] = sum(rec.exposed.values()) / st.acc
        per = kv + xy
        return floor + self.ctx.global_batch // (grid[0] * grid[2] * micro_batch) * per
