"""The pipeline axis of the 4D search: ``G_pipe x`` virtual stages ``x`` schedule on top of every
5D grid of ``GPUs / G_pipe`` ranks (:class:`PipeSearch`), added to the 5D search's top-K.

Space: ``G_pipe`` a divisor of the GPUs from 2 to the blocks; the 5D grid of the rest as in
:mod:`tetrad.plan.search.four_d` (model sharding, context split, ``B % (G_data G_z) == 0``, both
orientations); micro-batch ``b`` dividing ``B / (G_data G_z)``, ``m`` micro-batches; checkpointing
``none``, ``selective`` or ``full`` on every block (``selective`` only where ``none`` does not
fit, ``full`` only where neither does); schedules (:mod:`tetrad.plan.pipe.schedule`): ``1f1b``
where ``m >= G_pipe`` (GPipe has the same bubble and more memory, so it is tried only where 1F1B
cannot run) and ``interleaved-1f1b`` with ``v`` in :data:`VIRTUAL_CHOICES` (``G_pipe v <= L``,
``m % G_pipe == 0``). Memory: :func:`tetrad.plan.memory.pipeline.pipeline_memory` (worst rank,
80%); time: :func:`tetrad.plan.pipe.estimate.pipeline_estimate`.

Pruning, exact (no configuration that could enter the top-K is skipped):

1. per ``(G_context, G_y, G_x, mode)``: a rank does ``1/G_pipe`` of the model's blocks on
   ``B / (G_data G_z)`` samples, ``B G_context G_y G_x / GPUs`` samples' worth of whole-model
   work whatever ``G_pipe`` is; with every GEMM at the machine's best efficiency (attention and
   element-wise work are linear in the tokens) this is a lower bound of the step;
2. per ``(G_pipe, G_context, G_y, G_x, b, mode)``: the slowest rank's compute of one
   micro-batch, at least the average (the whole model's over ``G_pipe``) and at least
   ``ceil(L / G_pipe)`` blocks', times ``m + (G_pipe - 1) / v`` with the largest ``v`` allowed
   (the bubble), visited in ascending order of it; then with those blocks' exposed X/Y
   collectives added (the lesser orientation; each rank records exactly its blocks');
3. per configuration: ``(m + (p - 1) / v)`` times a rank of ``ceil(L / G_pipe)`` blocks, their
   compute, X/Y and context collectives, the Z seconds its windows cannot hide (as
   :class:`tetrad.plan.comm.bounds.StepBounds`) and the fewest point-to-point receives of a
   rank (the estimate without the step-level terms), first with the largest ``v`` per grid;
   then memory, then the estimate.

Groups are visited in ascending order of bound 1 and stop at the first whose bound is not below
the slowest of the top-K so far.
"""

from __future__ import annotations

import heapq

from tetrad.plan.comm.bounds import MARGIN
from tetrad.plan.comm.context_parallel import context_problems
from tetrad.plan.compute.block import block_compute
from tetrad.plan.memory.breakdown import FIT_FRACTION
from tetrad.plan.memory.pipeline import pipeline_memory, stage_parts
from tetrad.plan.model.grids import grid_problems
from tetrad.plan.pipe.estimate import (
    PipeConfig,
    PipeEstimate,
    block_xy,
    pipeline_estimate,
    split_ranks,
)
from tetrad.plan.pipe.schedule import RESIDUAL_BYTES, p2p_bytes, schedule_problems
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.search.pipe_floor import BlockFloors
from tetrad.plan.search.rows import Row
from tetrad.plan.search.space import divisors
from tetrad.spec import GRID_AXES, role_sizes

VIRTUAL_CHOICES = (2, 3, 4, 5, 6, 8)
"""Virtual stages per rank tried with ``interleaved-1f1b`` (NVIDIA's Llama-3 recipes use 5 and
8, torchtitan 2 by default)."""
MODE_ORDER = ("none", "selective", "full")


class PipeSearch(BlockFloors):
    """The pipeline part of one 4D search, sharing its :class:`~tetrad.plan.comm.context.Context`,
    memory limit and statistics (``search``: a :class:`tetrad.plan.search.four_d._Search4D`)."""

    def __init__(self, search, modes: tuple[str, ...], allowed: set | None):
        self.s = search
        self.ctx = search.ctx
        self.modes = tuple(m for m in MODE_ORDER if m in modes)
        self.allowed = allowed
        self.fit_memo: dict = {}
        self.floor_memo: dict = {}
        self.comm_memo: dict = {}
        self.z_memo: dict = {}
        self.stats = search.stats
        for k in ("pipe_groups", "pipe_candidates", "pipe_fitting", "pipe_evaluated"):
            self.stats.setdefault(k, 0)

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
        """``(bound 1, G_context, G_y, G_x, mode)`` of every tensor/context shape (the roles'
        sizes) that shards the model."""
        ctx, gpus, model = self.ctx, self.s.gpus, self.ctx.model
        out = []
        for gc in divisors(gpus // 2):
            if gc > 1 and context_problems(ctx.seq_len, gc):
                continue
            for gy in divisors(gpus // (2 * gc)):
                for gx in divisors(gpus // (2 * gc * gy)):
                    if grid_problems(model, (1, gc, 1, gy, gx)):
                        continue
                    share = ctx.global_batch * gc * gy * gx / gpus
                    for mode, floor in self._per_sample_floors(gc, gy, gx).items():
                        out.append((share * floor, gc, gy, gx, mode))
        out.sort(key=lambda t: t[0])
        return out

    def extend(self, best: list, top: int, seq0: int) -> None:
        """Push the pipeline configurations that enter the top-K into ``best`` (the max-heap of
        :meth:`tetrad.plan.search.four_d._Search4D.rank`), items numbered from ``seq0``."""
        self.seq = seq0
        groups = []
        for lb, gc, gy, gx, mode in self._tensor_groups():
            if len(best) >= top and lb * (1 - MARGIN) >= -best[0][0]:
                break
            self.stats["pipe_groups"] += 1
            for pipe in divisors(self.s.gpus):
                if 2 <= pipe <= self.ctx.model.n_layers:
                    groups += self._pipe_group(pipe, gc, gy, gx, mode)
        groups.sort(key=lambda t: t[0])
        for lb, pipe, q, gc, gy, gx, b, mode in groups:
            if len(best) >= top and lb * (1 - MARGIN) >= -best[0][0]:
                break
            if (
                len(best) >= top
                and self._xy_bound(lb, pipe, q, gc, gy, gx, b, mode, -best[0][0]) * (1 - MARGIN)
                >= -best[0][0]
            ):
                continue
            for gz in divisors(q):
                self._grids(best, top, pipe, (q // gz, gc, gz, gy, gx), b, mode)

    def _bubble_factor(self, pipe: int, m: int) -> float:
        """``m + (p - 1) / v`` with the largest ``v`` allowed (bound 2)."""
        vs = [v for v in VIRTUAL_CHOICES if pipe * v <= self.ctx.model.n_layers]
        v = max(vs) if vs and m % pipe == 0 else 1
        return m + (pipe - 1) / v

    def _pipe_group(self, pipe, gc, gy, gx, mode) -> list:
        """Bound 2 of each micro-batch of ``G_pipe = pipe`` on the roles ``(G_context, G_y,
        G_x)``: ``(bound, pipe, G_data G_z, G_context, G_y, G_x, b, mode)``."""
        ctx, out = self.ctx, []
        if (self.s.gpus // pipe) % (gc * gy * gx):
            return out
        q = self.s.gpus // (pipe * gc * gy * gx)  # G_data G_z
        if ctx.global_batch % q:
            return out
        per_cell = ctx.global_batch // q
        for b in divisors(per_cell):
            if self.allowed is not None and b not in self.allowed:
                continue
            m = per_cell // b
            fwd, bwd, rec = ctx.micro_batch_seconds((1, gc, 1, gy, gx), b, mode)
            block = split_costs(ctx.compute((1, gc, 1, gy, gx), b), mode)[0]
            slowest = max((fwd + bwd + rec) / pipe, self._most_blocks(pipe) * block)
            lb = self._bubble_factor(pipe, m) * slowest
            out.append((lb, pipe, q, gc, gy, gx, b, mode))
        return out

    def _most_blocks(self, pipe: int) -> int:
        """The fewest blocks the slowest of ``pipe`` ranks can hold: ``ceil(L / p)``."""
        return -(-self.ctx.model.n_layers // pipe)

    def _xy_bound(self, lb, pipe, q, gc, gy, gx, b, mode, limit=float("inf")) -> float:
        """Bound 2 with the blocks' exposed X/Y collectives (the lesser orientation) added to
        the compute of ``lb``; the first below ``limit`` (less MARGIN) ends it: no pruning."""
        ctx = self.ctx
        turns = [((q, gc, 1, gy, gx), "xy")]
        if gy > 1 and gx > 1:
            turns.append(((q, gc, 1, gx, gy), "yx"))
        m = ctx.global_batch // (q * b)
        scale = self._bubble_factor(pipe, m) * self._most_blocks(pipe)
        out = float("inf")
        for g, t in turns:
            out = min(out, lb + scale * sum(block_xy(ctx, g, b, mode, t)[0].values()))
            if out * (1 - MARGIN) < limit:
                break
        return out

    def _turns(self, roles: tuple) -> list:
        """``(--grid, orientation)`` of the roles ``roles``: the grid itself in ``xy``, and
        with ``G_y``, ``G_x`` both above 1 the grid that names them the other way in ``yx``."""
        gd, gc, gz, gy, gx = roles
        out = []
        if not grid_problems(self.ctx.model, roles):
            out.append((roles, "xy"))
        if gy > 1 and gx > 1:
            phys = (gd, gc, gz, gx, gy)
            if "yx" in self.s.orientations(phys):
                out.append((phys, "yx"))
        return out

    def _grids(self, best, top, pipe, roles, b, mode) -> None:
        """Every schedule of the grids whose roles are ``roles``."""
        m = self.ctx.global_batch // (roles[0] * roles[2] * b)
        for grid, turn in self._turns(roles):
            if len(best) >= top:
                floor = self._grid_floor(grid, turn, b, mode, pipe, m, -best[0][0])
                if floor * (1 - MARGIN) >= -best[0][0]:
                    continue
            for cfg in self._configs(pipe, m):
                self.stats["pipe_candidates"] += 1
                if len(best) >= top:
                    floor = self._config_floor(grid, turn, b, mode, cfg, m)
                    if floor * (1 - MARGIN) >= -best[0][0]:
                        continue
                mem = self._fitting(grid, turn, b, mode, cfg)
                if mem is None:
                    continue
                self.stats["pipe_fitting"] += 1
                self.stats["pipe_evaluated"] += 1
                est = pipeline_estimate(self.ctx, cfg, grid, b, mode, turn)
                item = (-est.step_s, self.seq, (grid, b, mode, turn, (est, cfg, mem)))
                self.seq += 1
                if len(best) < top:
                    heapq.heappush(best, item)
                elif est.step_s < -best[0][0]:
                    heapq.heapreplace(best, item)

    def _grid_floor(self, grid, turn, b, mode, pipe: int, m: int, limit=float("inf")) -> float:
        """Bound 3 of every schedule of ``grid``: the average rank (``1/p`` of the whole
        model's terms of :meth:`_block_floor`) times ``m + (p - 1) / v`` with the largest
        ``v``; without the Z term where that is already not below ``limit`` (less MARGIN)."""
        block, k = self._base_floor(grid, turn, b, mode)[0], self._most_blocks(pipe)
        bf = self._bubble_factor(pipe, m)
        if bf * (k * block) * (1 - MARGIN) >= limit:
            return bf * (k * block)
        zb, ze = self._z_floor(grid, turn, b, mode == "full")
        return bf * (k * block + max(0.0, k * zb - ze))

    def _config_floor(self, grid, turn, b, mode, cfg: PipeConfig, m: int) -> float:
        """Bound 3 (module doc): ``(m + (p - 1) / v)`` times a rank of ``ceil(L / p)`` blocks:
        their compute, X/Y, context and Z floor, and the fewest point-to-point receives of a
        rank (``2 v - 1``; the estimate without the step-level terms)."""
        ctx, p = self.ctx, cfg.pipe
        block, _, zb, ze = self._block_floor(grid, turn, b, mode)
        roles = role_sizes(grid, turn)
        nbytes = p2p_bytes(b, ctx.seq_len, ctx.model.hidden, roles[1], roles[4], RESIDUAL_BYTES)
        world5 = grid[0] * grid[1] * grid[2] * grid[3] * grid[4]
        link = ctx.machine.network.link(world5, 2)
        one = link.base_latency + nbytes / link.bandwidth
        k = self._most_blocks(p)
        slowest = k * block + max(0.0, k * zb - ze) + (2 * cfg.virtual - 1) * one
        v = cfg.virtual if cfg.schedule == "interleaved-1f1b" else 1
        return (m + (p - 1) / v) * slowest

    def _configs(self, pipe: int, m: int) -> list[PipeConfig]:
        """The schedules of the module doc for ``p = pipe`` and ``m`` micro-batches."""
        out = []
        if not schedule_problems("1f1b", pipe, 1, m):
            out.append(PipeConfig(pipe, 1, "1f1b"))
        else:
            out.append(PipeConfig(pipe, 1, "gpipe"))
        for v in VIRTUAL_CHOICES:
            if pipe * v <= self.ctx.model.n_layers and not schedule_problems(
                "interleaved-1f1b", pipe, v, m
            ):
                out.append(PipeConfig(pipe, v, "interleaved-1f1b"))
        return out

    def memory(self, grid, turn: str, b: int, mode: str, cfg: PipeConfig):
        """The worst rank's :class:`~tetrad.plan.memory.breakdown.MemoryBreakdown` and every
        rank's (:func:`tetrad.plan.memory.pipeline.pipeline_memory`)."""
        ctx, s = self.ctx, self.s
        roles = role_sizes(grid, turn)
        ranks = split_ranks(
            ctx.model.n_layers, split_costs(ctx.compute(roles, b), mode), cfg.pipe, cfg.virtual
        )
        m = ctx.global_batch // (grid[0] * grid[2] * b)
        return pipeline_memory(
            ctx.model,
            roles,
            b,
            ctx.seq_len,
            s.mem_bytes,
            ranks,
            cfg.schedule,
            cfg.virtual,
            m,
            activation_checkpointing=mode,
            dtype=s.dtype,
            prefetch=s.prefetch,
        )

    def _memory_floor(self, grid, turn, b, mode, cfg: PipeConfig) -> float:
        """Bytes the most loaded rank holds at least: ``k = ceil(L / p)`` blocks' AdamW states
        (16 bytes per element) and one micro-batch's saved activations of ``ceil(k / v)`` of them
        (one stage in flight)."""
        roles = role_sizes(grid, turn)
        _, block_el, _, _ = self.ctx.weight_shards(roles[4], roles[3], roles[2])
        k = self._most_blocks(cfg.pipe)
        one = stage_parts(
            self.ctx.model, 1, roles, b, self.ctx.seq_len, mode, self.s.dtype, self.s.prefetch
        )[2]["blocks"]
        return 16.0 * k * block_el + -(-k // cfg.virtual) * one

    def _fits(self, grid, turn, b, mode, cfg):
        key = (grid, turn, b, mode, cfg)
        got = self.fit_memo.get(key, 0)
        if (
            got == 0
            and self._memory_floor(grid, turn, b, mode, cfg) > FIT_FRACTION * self.s.mem_bytes
        ):
            got = self.fit_memo[key] = None
        if got == 0:
            worst, _ = self.memory(grid, turn, b, mode, cfg)
            got = self.fit_memo[key] = (
                worst if worst.total <= FIT_FRACTION * self.s.mem_bytes else None
            )
        return got

    def _fitting(self, grid, turn, b, mode, cfg):
        """The memory of the configuration when it fits and no cheaper mode fits."""
        for cheaper in MODE_ORDER[: MODE_ORDER.index(mode)]:
            if cheaper in self.modes and self._fits(grid, turn, b, cheaper, cfg) is not None:
                return None
        return self._fits(grid, turn, b, mode, cfg)


def is_pipeline(est) -> bool:
    """Whether a ranked item's estimate is a pipeline's ``(PipeEstimate, PipeConfig, memory)``."""
    return isinstance(est, tuple) and isinstance(est[0], PipeEstimate)


def pipeline_row(search, step: float, grid, b: int, mode: str, turn: str, item) -> Row:
    """The :class:`~tetrad.plan.search.rows.Row` of a ranked pipeline configuration (``item``:
    its ``(PipeEstimate, PipeConfig, memory)``), with every rank's memory."""
    est, cfg, _ = item
    ctx = search.ctx
    worst, per_rank = PipeSearch(search, (mode,), None).memory(grid, turn, b, mode, cfg)
    return Row(
        "4d",
        dict(zip(GRID_AXES, grid, strict=True)),
        b,
        est.grad_accum,
        mode,
        est.step_s,
        est.compute_s,
        est.recompute_s,
        dict(est.exposed_s),
        dict(est.comm_s),
        0.0,
        0.0,
        worst,
        search.comm_model,
        {"pipeline_bubble": est.bubble_s},
        orientation=turn,
        pipe=cfg.pipe,
        virtual_stages=cfg.virtual,
        schedule=cfg.schedule,
        stage_memory=per_rank,
    ).finish(ctx.model, ctx.machine, search.gpus, ctx.global_batch, ctx.seq_len)
