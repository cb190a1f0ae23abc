"""Step time of a pipeline grid ``(G_pipe, G_data, G_context, G_z, G_y, G_x)``
(:func:`pipeline_estimate`).

Within a stage everything is as without a pipeline: each pipeline rank is timed by the per-layer
model of :mod:`tetrad.plan.step_time` (the same layer kinds, overlaps and links of the 5D
grid of ``world / G_pipe`` ranks) applied to its own blocks only; the embedding's compute and
collectives only on the rank of stage 0, the final norm's, LM head's and loss's only on the
rank of the last stage (:mod:`tetrad.plan.pipe.stages`). Per rank ``r`` and micro-batch:

    T_r = F_r + B_r + R_r + X_r + P_r

compute forward, backward, recompute; ``X_r`` the exposed seconds of its per-micro-batch
collectives (X, Y, Z, context; the per-step ones are in the tail); ``P_r`` its point-to-point
receives: one activation per stage but stage 0 and one gradient per stage but the last
(:func:`tetrad.plan.pipe.schedule.boundaries_of_rank`), each ``p2p_bytes`` over the link of
two ranks ``world / G_pipe`` apart (across nodes when that is at least the GPUs per node), on
the critical path (torch.distributed.pipelining waits for a stage's receive before its compute;
the same as the classic space's model). Each rank's time splits over its stages
(:mod:`tetrad.plan.pipe.stage_times`: forward and backward seconds per stage), and the step is

    step = S + max_r (optimizer_r + max(0, D_r - r (B_r + R_r) / v))

``S`` the critical path of the schedule that runs on these stage times
(:func:`tetrad.plan.pipe.critical_path.schedule_step`: GPipe's, 1F1B's or interleaved 1F1B's
order, as torch runs them): ``(m + (p - 1) / v) T`` on ``p`` equal ranks (Narayanan et al.,
arXiv 2104.04473, section 2.2), and on the runtime's uneven split what the other ranks leave
idle on the slowest; the bubble is ``S - m max_r T_r``. ``D_r`` is the exposed data-parallel
gradient reduction and step scalars of rank ``r`` as without a pipeline, started after its last
backward: rank ``r``'s last backward ends ``r`` stage backwards before rank 0's (the
cool-down), which hides that much of it (inferred from the schedules' order; the runtime's
``dp_all_reduce`` overlap inside the last micro-batch's backward is kept as the per-layer model
has it).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.plan.comm import layers, linears
from tetrad.plan.comm.record import Recorder
from tetrad.plan.compute.elementwise import optimizer_seconds
from tetrad.plan.pipe.critical_path import schedule_step
from tetrad.plan.pipe.schedule import boundaries_of_rank, p2p_bytes
from tetrad.plan.pipe.stage_times import stage_times
from tetrad.plan.pipe.stages import (
    PipeRank,
    balanced_stages,
    pipe_ranks,
    split_costs,
    stage_model,
)
from tetrad.plan.question import FLAG, StepQuestion, shards_optimizer
from tetrad.plan.step_time import LAYER_KINDS, make_step, sequence_parallel_applies
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.grid import COMM_AXES, physical_axis, role_sizes, with_context

STEP_KINDS = (layers.data_gradients, layers.step_scalars)
"""The layer kinds recorded once per step (after the last backward), not per micro-batch."""
PIPE_AXIS = "pipe"
"""The key of the point-to-point seconds in :attr:`PipeEstimate.exposed_s`."""


@dataclass(frozen=True)
class PipeConfig:
    """The pipeline part of a configuration: ``pipe`` ranks, ``virtual`` stages per rank and
    the schedule (:data:`tetrad.plan.pipe.schedule.SCHEDULES`)."""

    pipe: int
    virtual: int = 1
    schedule: str = "1f1b"


@dataclass(frozen=True)
class RankTime:
    """One pipeline rank per micro-batch (seconds) and per step.

    Attributes:
        fwd, bwd, rec: compute of one micro-batch (all its stages).
        exposed: per-micro-batch exposed collectives per axis; ``total``: all of them.
        tail: exposed per-step collectives per axis (data-parallel gradients, scalars).
        tail_total: all per-step collectives per axis.
        optimizer: AdamW over its shards, per step.
        p2p: its point-to-point receive seconds per micro-batch; ``p2p_bytes``: the bytes it
            sends per micro-batch (both directions).
    """

    fwd: float
    bwd: float
    rec: float
    exposed: dict
    total: dict
    tail: dict
    tail_total: dict
    optimizer: float
    p2p: float
    p2p_bytes: float

    @property
    def per_micro_batch(self) -> float:
        """``T_r`` of the module doc."""
        return self.fwd + self.bwd + self.rec + sum(self.exposed.values()) + self.p2p


@dataclass(frozen=True)
class PipeEstimate:
    """Predicted step of a pipeline grid (seconds), the slowest rank's breakdown.

    Attributes:
        step_s: step time; compute_s: the slowest rank's compute (recompute and optimizer
            incl.); recompute_s: of which recomputation; bubble_s: the pipeline bubble.
        exposed_s: the slowest rank's exposed communication per axis, ``pipe`` for its
            point-to-point receives; comm_s: all of it per axis.
        grad_accum: micro-batches per step ``m``.
        ranks: every pipeline rank's :class:`RankTime`; slowest: the index of the slowest.
        p2p_bytes_per_boundary: bytes per stage boundary, micro-batch and direction per rank.
    """

    step_s: float
    compute_s: float
    recompute_s: float
    bubble_s: float
    exposed_s: dict
    comm_s: dict
    grad_accum: int
    ranks: tuple
    slowest: int
    p2p_bytes_per_boundary: float
    orientation: str = "xy"


def stage_question(ctx: StepQuestion, blocks: int) -> StepQuestion:
    """The question ``ctx`` asked of a model of ``blocks`` blocks (a pipeline rank's), with its
    options (overlaps, piece counts, the sharded optimizer), memoised in ``ctx``."""
    cache = ctx.__dict__.setdefault("_stage_questions", {})
    got = cache.get(blocks)
    if got is None:
        model = stage_model(ctx.model, blocks)
        got = StepQuestion(
            model,
            ctx.machine,
            ctx.seq_len,
            ctx.global_batch,
            compute_bytes=ctx.c,
            param_bytes=ctx.param_bytes,
            residual_bytes=ctx.residual_bytes,
            fp8=ctx.fp8,
        )
        got.overlaps, got.fine = ctx.overlaps, ctx.fine
        got.bucket_bytes, got.domino_min_rows = ctx.bucket_bytes, ctx.domino_min_rows
        got.context_pieces = ctx.context_pieces
        got.sequence_parallel = getattr(ctx, "sequence_parallel", False)
        setattr(got, FLAG, shards_optimizer(ctx))
        cache[blocks] = got
    return got


def block_xy(ctx: StepQuestion, grid, micro_batch: int, ckpt: str, turn: str) -> tuple[dict, dict]:
    """``(exposed, all)`` seconds per axis of one block's Linear X/Y collectives per
    micro-batch (:func:`tetrad.plan.comm.linears.block_linears` records ``L`` blocks times
    ``m`` micro-batches of the same), memoised per ``(G_context, G_y, G_x, b, full
    recompute, orientation)``, on which alone they depend (X and Y are the innermost axes):
    recorded on that grid with ``G_data = G_z = 1``, so that the seconds, to the last bit, do
    not depend on which grid asked first."""
    physical = with_context(grid)
    full = parse_checkpointing(ckpt) == "full"
    key = (physical[1], physical[3], physical[4], micro_batch, full, turn)
    memo = ctx.__dict__.setdefault("_block_xy", {})
    got = memo.get(key)
    if got is None:
        canon = (1, physical[1], 1, physical[3], physical[4])
        st = make_step(ctx, canon, micro_batch, ckpt, turn)
        rec = Recorder(False)
        linears.block_linears(rec, st)
        n = st.n_layers * st.acc
        got = memo[key] = (
            {a: v / n for a, v in rec.exposed.items()},
            {a: v / n for a, v in rec.total.items()},
        )
    return got


def rank_time(
    ctx: StepQuestion,
    grid,
    micro_batch: int,
    ckpt: str,
    turn: str,
    prank: PipeRank,
    cfg: PipeConfig,
) -> RankTime:
    """:class:`RankTime` of pipeline rank ``prank`` on the 5D ``grid`` (module doc)."""
    sctx = stage_question(ctx, prank.blocks)
    # one stage is the 4D step, whose micro-batches run whole (the prefetch order wraps)
    st = make_step(sctx, grid, micro_batch, ckpt, turn, wrap=cfg.pipe == 1)
    if not prank.last:
        st.head_el = 0.0
    if not prank.first:
        st.emb_el = 0.0
    if cfg.schedule == "interleaved-1f1b":  # the next forward's stage order (gather_units)
        st.chunks, st.rounds = cfg.virtual, min(cfg.pipe, st.acc)
        st.chunk_blocks = prank.chunk_blocks
    mb, tail = Recorder(False), Recorder(False)
    per_block = block_xy(ctx, grid, micro_batch, ckpt, turn)
    for d, src in ((mb.exposed, per_block[0]), (mb.total, per_block[1])):
        for a, v in src.items():
            d[a] += prank.blocks * st.acc * v
    skip = {linears.block_linears}
    if not prank.last:
        skip |= {layers.lm_head, layers.loss}
    if not prank.first:
        skip.add(layers.embedding)
    for kind in LAYER_KINDS:
        if kind not in skip:
            kind(tail if kind in STEP_KINDS else mb, st)
    c, k = st.comp, prank.blocks
    fwd = k * c.block_fwd
    bwd = k * c.block_bwd
    if prank.first:
        fwd, bwd = fwd + c.embedding_fwd, bwd + c.embedding_bwd
    if prank.last:
        fwd += c.final_norm_fwd + 3.0 * c.head + c.loss_fwd
        bwd += c.final_norm_bwd + c.loss_bwd
    rec = st.comp.micro_batch_seconds(k, ckpt)[2]
    local = k * st.block_el + st.head_el + st.emb_el + st.vector_el
    opt = optimizer_seconds(local, ctx.machine.hbm_bytes_per_s, st.optimizer_shards, st.param_bytes)
    # the residual stream [b, S / G_context, h / G_x] (G_x of the X role; under sequence
    # parallelism [b, S / (G_context G_y), h])
    nbytes = p2p_bytes(
        micro_batch,
        ctx.seq_len,
        ctx.model.dim,
        st.sizes["context"],
        st.sizes["x"],
        ctx.c,
        st.sizes["y"] if st.sequence_parallel else 1,
    )
    world5 = 1
    for g in with_context(grid):
        world5 *= g
    link = ctx.machine.network.link(world5, 2)  # ranks world / G_pipe apart
    f_in, b_in = boundaries_of_rank(cfg.pipe, prank.rank, cfg.virtual)
    one = link.base_latency + nbytes / link.bandwidth
    acc = st.acc

    def per_mb(d: dict) -> dict:
        return {physical_axis(a, turn): v / acc for a, v in d.items()}

    def per_step(d: dict) -> dict:
        return {physical_axis(a, turn): v for a, v in d.items()}

    return RankTime(
        fwd,
        bwd,
        rec,
        per_mb(mb.exposed),
        per_mb(mb.total),
        per_step(tail.exposed),
        per_step(tail.total),
        opt,
        (f_in + b_in) * one,
        (f_in + b_in) * nbytes,
    )


def cached_rank_time(
    ctx: StepQuestion,
    grid,
    micro_batch: int,
    ckpt: str,
    turn: str,
    prank: PipeRank,
    cfg: PipeConfig,
) -> RankTime:
    """:func:`rank_time`, memoised in ``ctx`` on what it depends on (the estimate and the
    search's bounds share it)."""
    memo = ctx.__dict__.setdefault("_rank_times", {})
    key = (grid, micro_batch, ckpt, turn, prank.blocks, prank.first, prank.last, cfg.schedule)
    key += (cfg.pipe,)
    key += boundaries_of_rank(cfg.pipe, prank.rank, cfg.virtual)
    got = memo.get(key)
    if got is None:
        got = memo[key] = rank_time(ctx, grid, micro_batch, ckpt, turn, prank, cfg)
    return got


def pipeline_estimate(
    ctx: StepQuestion,
    cfg: PipeConfig,
    grid,
    micro_batch: int,
    ckpt: str,
    turn: str = "xy",
    ranks: tuple[PipeRank, ...] | None = None,
) -> PipeEstimate:
    """Predicted step of ``cfg`` on the 5D ``grid = (G_data, [G_context,] G_z, G_y, G_x)`` of
    ``world / G_pipe`` ranks in orientation ``turn`` (module doc). ``ckpt``: ``none``,
    ``selective`` or ``full`` for every block. ``ranks``: the stage split (default: the
    runtime's, :func:`split_ranks` of this model's compute).

    Raises:
        PlanError: the batch does not split into micro-batches on this grid.
        tetrad.spec.pipeline_split.PipelineSplitError: more stages than blocks.
    """
    comp = ctx.compute(role_sizes(with_context(grid), turn), micro_batch)
    if ranks is None:
        ranks = split_ranks(ctx.model.n_layers, split_costs(comp, ckpt), cfg.pipe, cfg.virtual)
    times = [cached_rank_time(ctx, grid, micro_batch, ckpt, turn, r, cfg) for r in ranks]
    physical = with_context(grid)
    acc = ctx.global_batch // (physical[0] * physical[2] * micro_batch)
    slow = max(range(len(times)), key=lambda i: times[i].per_micro_batch)
    t_max = times[slow].per_micro_batch
    chain = critical_path(comp, ckpt, ranks, times, cfg, acc)
    bubble = chain - acc * t_max
    tails = [rank_tail(t, r, cfg.virtual) for r, t in enumerate(times)]
    end = max(range(len(times)), key=lambda i: tails[i])
    w = times[slow]
    compute = acc * (w.fwd + w.bwd + w.rec) + w.optimizer
    exposed = {a: acc * w.exposed.get(a, 0.0) for a in COMM_AXES}
    tail = times[end].tail
    left = tails[end] - times[end].optimizer  # what the cool-down does not hide
    whole = sum(tail.values())
    for a, v in tail.items():
        exposed[a] = exposed.get(a, 0.0) + (v * left / whole if whole > 0 else 0.0)
    exposed[PIPE_AXIS] = acc * w.p2p
    comm = {a: acc * w.total.get(a, 0.0) + w.tail_total.get(a, 0.0) for a in COMM_AXES}
    comm[PIPE_AXIS] = exposed[PIPE_AXIS]
    step = chain + tails[end]
    roles = role_sizes(physical, turn)
    per_boundary = p2p_bytes(
        micro_batch,
        ctx.seq_len,
        ctx.model.dim,
        physical[1],
        roles[4],
        ctx.c,
        roles[3] if sequence_parallel_applies(ctx, roles) else 1,
    )
    return PipeEstimate(
        step,
        compute,
        acc * w.rec,
        bubble,
        exposed,
        comm,
        acc,
        tuple(times),
        slow,
        per_boundary,
        turn,
    )


def rank_tail(t: RankTime, rank: int, virtual: int) -> float:
    """``optimizer_r + max(0, D_r - r (B_r + R_r) / v)`` of the module doc: what pipeline rank
    ``rank`` (its :class:`RankTime` ``t``) adds to the step after its last backward, seconds;
    the step is the critical path plus the largest over the ranks."""
    slack = rank * (t.bwd + t.rec) / virtual
    return t.optimizer + max(0.0, sum(t.tail.values()) - slack)


def critical_path(comp, ckpt: str, ranks, times, cfg: PipeConfig, acc: int) -> float:
    """``S`` of the module doc, seconds: the schedule's critical path over ``acc``
    micro-batches on the stage times of the ranks' ``times`` (``acc`` times the one rank's time
    where ``p = 1``)."""
    if cfg.pipe == 1:
        return acc * times[0].per_micro_batch
    fwd, bwd = stage_times(comp, ckpt, ranks, times, cfg.pipe, cfg.virtual)
    return schedule_step(cfg.schedule, cfg.pipe, cfg.virtual, acc, fwd, bwd)


_SPLITS: dict = {}
SPLIT_QUANTUM = 0.25
"""Blocks' worth to which the embedding's and the head's costs are rounded for the split."""


def split_key(
    n_layers: int, costs: tuple[float, float, float], pipe: int, virtual: int
) -> tuple[int, float, float, int, int]:
    """What :func:`split_ranks` depends on: ``(L, embedding, head, p, v)``, the embedding's and
    the head's cost in blocks rounded to :data:`SPLIT_QUANTUM`."""
    block, emb, head = costs
    q = SPLIT_QUANTUM
    return (n_layers, round(emb / block / q) * q, round(head / block / q) * q, pipe, virtual)


def split_ranks(
    n_layers: int, costs: tuple[float, float, float], pipe: int, virtual: int
) -> tuple[PipeRank, ...]:
    """:func:`tetrad.plan.pipe.stages.pipe_ranks`, memoised on the embedding's and head's cost
    in blocks rounded to :data:`SPLIT_QUANTUM` (the split depends on the cost ratios only; the
    runtime, splitting by its exact costs, differs only within that much of a tie)."""
    key = split_key(n_layers, costs, pipe, virtual)
    got = _SPLITS.get(key)
    if got is None:
        got = _SPLITS[key] = pipe_ranks(n_layers, (1.0, key[1], key[2]), pipe, virtual)
    return got


def planner_split(
    n_layers: int, costs: tuple[float, float, float], pipe: int, virtual: int
) -> tuple[tuple[int, int], ...]:
    """The stage split whose ranks :func:`split_ranks` returns (``(start, stop)`` blocks per
    stage, ``p v`` stages): what the runtime's :class:`tetrad.pipeline.schedule.Pipeline` takes
    to run the split the planner timed.

    Raises:
        tetrad.spec.pipeline_split.PipelineSplitError: ``p v`` above the blocks.
    """
    _, emb, head, _, _ = split_key(n_layers, costs, pipe, virtual)
    return balanced_stages(n_layers, (1.0, emb, head), pipe * virtual)
