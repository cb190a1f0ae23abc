"""Step-time model of a mixture-of-experts model on tetrad's grid (:func:`moe_estimate`): the
dense step model (:mod:`tetrad.plan.step_time`, with a pipeline :mod:`tetrad.plan.pipe.
pipeline_step`) of a stand-in dense model for everything but the routed experts, plus the
routed experts' own terms, per MoE block and micro-batch, on the busiest rank.

The stand-in (:func:`dense_stand_in`) is the model with each block's FFN the mean dense FFN of
its blocks (the dense blocks' ``f``, the MoE blocks' shared expert ``f_s``), at least
:data:`STAND_IN_MIN_FFN` wide so that it shards on every grid: attention, the shared expert and
the dense FFNs keep their exact collectives (Z, X, Y, context, data, LM head, embedding, norms,
overlaps); the stand-in's FFN collectives on X and Y stand for the MoE block's token split and
join over X and Y (:mod:`tetrad.parallel.moe_tensor`: an all-to-all and an all-gather of the
block's ``[m, h]`` rows, of the order of the FFN's all-reduces of them); the GEMM seconds of the
stand-in's width beyond the real mean are taken off again.

Routed experts, per MoE block and micro-batch, ``T = m / (G_y G_x)`` tokens routed on the rank
(each tensor rank routes its slice), ``k`` top-k, ``P = G_expert`` (folded over all ranks of a
pipeline stage, innermost first, as the runtime does: MoE Parallel Folding with ``ETP = 1``,
Liu et al., arXiv 2504.14960; an expert group is ``P`` consecutive stage ranks, stride 1, in
one node whenever ``P`` is at most its GPUs),
``R = T k imbalance`` rows on the busiest rank (``imbalance``: ``--moe-imbalance``, its rows
over the mean; 1 without expert parallelism), compute dtype ``c`` bytes:

    router     GEMM 2 T E h FLOPs forward; dx and dW the same in backward
    experts    3 grouped GEMMs over the E/P local experts, 2 R h f_e FLOPs each, timed at the
               machine's efficiency for one group's GEMM (R P / E rows): forward; dx and dW
    memory     router softmax and top-k, the rows' permutation and the combine, SwiGLU on
               R x f_e: bytes / HBM bandwidth (MOE_ELEMENTWISE); backward twice that
    dispatch   all-to-all of the rows, T k h c (P - 1)/P bytes sent, imbalance x that received
    combine    the same back; forward 2 row all-to-alls and one of the E counts (int64, then a
               host read of the splits); backward 2; full recomputation the forward's 3 again
               (:func:`tetrad.plan.comm.experts.all_to_all_seconds`, on the network
               hierarchy). Without the ``expert`` overlap all blocking, all exposed; with it
               the tokens in ``n`` pieces (:func:`tetrad.spec.overlap.expert_pieces`): the
               counts exposed, each piece's row exchanges behind the other pieces' expert
               GEMMs and SwiGLU as the runtime orders them
               (:func:`tetrad.plan.comm.experts.pipelined_seconds`), each piece's GEMMs timed
               at its own rows' efficiency

Per step: the expert weights' gradients (fp32, ``3 (E/P) h f_e`` per MoE block) summed over
their expert-data group only (the stage's ``G_data G_context G_z G_y G_x / P`` ranks at stride
``P``: one all-reduce), after backward, blocking (``sync_gradients``); the routers' (and with
``P = 1`` the whole experts') over Z, data, Y and X; AdamW over the local expert and router
weights. With a pipeline of ``p`` stages (1F1B, the runtime's split: :func:`moe_split`) the
per-micro-batch terms of the slowest stage's MoE blocks grow the critical path ``m + p - 1``
times (its bubble ``p - 1`` times).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from tetrad.plan.comm.experts import COUNT_BYTES, all_to_all_seconds, pipelined_seconds
from tetrad.plan.compute.elementwise import ELEMENTWISE, optimizer_seconds
from tetrad.plan.machine.network import ALL_REDUCE
from tetrad.plan.memory.sharded_optimizer import data_group, expert_data_group
from tetrad.plan.pipe.pipeline_step import PipeConfig, pipeline_estimate, split_ranks
from tetrad.plan.pipe.stages import split_costs
from tetrad.plan.question import StepQuestion, sharded, shards_optimizer
from tetrad.plan.step_time import estimate
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.grid import role_sizes, with_context
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import EXPERT_PIECES, expert_pieces, piece_sizes
from tetrad.spec.units import FP32

STAND_IN_MIN_FFN = 128
"""The narrowest FFN of :func:`dense_stand_in` (divisible by every power-of-two ``G_y`` up to
128)."""

MOE_ELEMENTWISE = {
    "router_per_score": 16.0,
    "permute_per_slot_h": 4.0,
    "combine_per_slot_h": 10.0,
}
"""Bytes moved per element by an MoE block's memory-bound work (rough counts of the runtime's
unfused ops, tetrad/models/moe.py, forward; SwiGLU on the experts' rows uses
``ELEMENTWISE["act_per_f_llama"]``): ``router_per_score`` (per ``[T, E]`` score: fp32 logits
cast, softmax or sigmoid, top-k, gather), ``permute_per_slot_h`` (per slot and feature, ``c =
2``: the rows gathered in expert order and put back, read and write), ``combine_per_slot_h``
(per slot and feature, bf16: times its weight, read and write; put back in token order, read
and write; read by the fp32 sum over ``k``)."""


@functools.lru_cache(maxsize=64)
def dense_stand_in(model: ModelSpec) -> ModelSpec:
    """The dense model whose step :func:`moe_estimate` takes for everything but the routed
    experts (module doc): ``model`` without experts, each block's FFN the mean of its dense
    blocks' ``f`` and MoE blocks' ``f_s``, rounded up to a multiple of
    :data:`STAND_IN_MIN_FFN`."""
    width = max(real_ffn_mean(model), 1.0)
    ffn = STAND_IN_MIN_FFN * math.ceil(width / STAND_IN_MIN_FFN)
    return dataclasses.replace(
        model,
        name=f"{model.name} (dense stand-in)",
        ffn_dim=ffn,
        n_experts=0,
        shared_ffn_dim=0,
        dense_layers=0,
        aux_loss_coef=0.0,
        bias_update_rate=0.0,
    )


def real_ffn_mean(model: ModelSpec) -> float:
    """The mean dense FFN width over the blocks: ``((L - L_m) f + L_m f_s) / L``."""
    return (model.dense_blocks * model.ffn_dim + model.moe_layers * model.shared_ffn_dim) / (
        model.n_layers
    )


@dataclass(frozen=True)
class ExpertTimes:
    """The routed experts' seconds on the busiest rank, per MoE block and micro-batch.

    Attributes:
        fwd, bwd: compute (router and expert GEMMs, element-wise work), forward and backward.
        a2a_fwd, a2a_bwd: exposed all-to-alls (counts and rows), forward and backward.
        a2a_total_fwd, a2a_total_bwd: all the all-to-alls' seconds, forward and backward
            (what the exposed parts come from).
        fake_ffn: the GEMM seconds of the stand-in's FFN width beyond the real mean, per block
            and micro-batch, forward (its backward: twice that).
    """

    fwd: float
    bwd: float
    a2a_fwd: float
    a2a_bwd: float
    fake_ffn: float
    a2a_total_fwd: float = 0.0
    a2a_total_bwd: float = 0.0


def expert_times(
    ctx: StepQuestion,
    stand_in: StepQuestion,
    roles: tuple,
    micro_batch: int,
    expert: int,
    imbalance: float,
    pieces: int | None = None,
) -> ExpertTimes:
    """:class:`ExpertTimes` of the roles ``(G_data, G_context, G_z, G_y, G_x)`` (module doc);
    ``stand_in``: the question of :func:`dense_stand_in`; ``pieces``: the ``expert``
    overlap's pieces (None: the runtime's, :data:`tetrad.spec.overlap.EXPERT_PIECES` when the
    question's overlaps name ``expert``, else 1)."""
    model, machine = ctx.model, ctx.machine
    gd, gc, gz, gy, gx = roles
    m = micro_batch * ctx.seq_len / gc
    t = m / (gy * gx)
    k, h, e, f = model.top_k, model.dim, model.n_experts, model.expert_dim
    imb = imbalance if expert > 1 else 1.0
    rows = t * k * imb
    local = e // expert
    if pieces is None:
        pieces = EXPERT_PIECES if "expert" in ctx.overlaps else 1
    n = expert_pieces(round(t), pieces) if expert > 1 else 1
    sizes = piece_sizes(round(t), n) if n > 1 else [t]
    router = ctx.gemm_s(2.0 * t * e * h)
    act_per_row = ELEMENTWISE["act_per_f_llama"] * f / machine.hbm_bytes_per_s
    piece_fwd = []  # each piece's expert GEMMs and SwiGLU, forward
    for size in sizes:
        per_group = 2.0 * size * k * imb * h * f / local  # one expert's GEMM
        gemms = 3 * local * per_group / (machine.peak_flops * machine.gemm_efficiency(per_group))
        piece_fwd.append(gemms + act_per_row * size * k * imb)
    grouped = sum(piece_fwd) - act_per_row * rows
    ew = MOE_ELEMENTWISE
    moved = (
        ew["router_per_score"] * t * e
        + ew["permute_per_slot_h"] * ctx.c / 2 * t * k * h
        + ew["combine_per_slot_h"] * t * k * h
        + ELEMENTWISE["act_per_f_llama"] * rows * f
    ) / machine.hbm_bytes_per_s
    fwd = router + grouped + moved
    bwd = 2 * (router + grouped) + ELEMENTWISE["backward_factor"] * moved
    a2a_fwd = a2a_bwd = total_fwd = total_bwd = 0.0
    if expert > 1:  # the expert group: ``expert`` consecutive stage ranks
        net = machine.network
        sent = [s * k * h * ctx.c * (expert - 1) / expert * max(1.0, imb) for s in sizes]
        row = [all_to_all_seconds(net, 1, expert, b) for b in sent]
        counts = all_to_all_seconds(net, 1, expert, COUNT_BYTES * (e - local) * n)
        # backward: dx and dW GEMMs, SwiGLU's backward; the pieces in reverse order
        bf = ELEMENTWISE["backward_factor"]
        piece_bwd = [
            2 * (c - act_per_row * s * k * imb) + bf * act_per_row * s * k * imb
            for c, s in zip(piece_fwd, sizes, strict=True)
        ][::-1]
        a2a_fwd = counts + pipelined_seconds(row, piece_fwd, row) - sum(piece_fwd)
        a2a_bwd = pipelined_seconds(row[::-1], piece_bwd, row[::-1]) - sum(piece_bwd)
        total_fwd, total_bwd = counts + 2 * sum(row), 2 * sum(row)
    comp = stand_in.compute(roles, micro_batch)
    fake = 1.0 - real_ffn_mean(model) / stand_in.model.ffn_dim
    fake_ffn = fake * (comp.gemm[-2] + comp.gemm[-1])
    return ExpertTimes(fwd, bwd, a2a_fwd, a2a_bwd, fake_ffn, total_fwd, total_bwd)


def expert_sync_exposed(
    ctx: StepQuestion, seconds: float, blocks: int, block_backward: float
) -> float:
    """The exposed seconds of the expert gradients' sum over expert-data (``seconds`` in all,
    :func:`grad_sync_seconds`) on a rank of ``blocks`` MoE blocks whose last micro-batch's
    backward takes ``block_backward`` seconds per block: all of it after backward without the
    ``dp_all_reduce`` overlap; with it one block's share issued as each block's experts finish
    (tetrad/parallel/expert_grads.py), on one communicator, each share hidden behind the
    backward of the blocks below it: the last block's share and whatever the shares exceed
    the backward by."""
    if "dp_all_reduce" not in ctx.overlaps or seconds == 0 or blocks < 1:
        return seconds
    share = seconds / blocks
    return share + (blocks - 1) * max(0.0, share - block_backward)


def grad_sync_seconds(
    ctx: StepQuestion, roles: tuple, expert: int, pipe: int = 1
) -> tuple[float, float]:
    """``(expert-axis seconds, data seconds)`` of the per-step gradient sums the stand-in does
    not have, blocking (module doc): the expert-sharded weights' one all-reduce over their
    expert-data group (the stage's ranks over ``expert``, at stride ``expert``; with the
    sharded optimizer a reduce-scatter over it and, after the update, an all-gather of the
    pieces, the same ring bytes, counted as that all-reduce: the all-gather's overlap with the
    next forward is not taken off); the routers'
    (and with ``expert = 1`` the whole experts') over Z, data, Y and X; one pipeline stage's
    share with ``pipe`` stages."""
    model, net = ctx.model, ctx.machine.network
    gd, gc, gz, gy, gx = roles
    lm = model.moe_layers / pipe
    experts = FP32 * lm * model.expert_params() / expert
    routers = FP32 * lm * model.router_params() + (experts if expert == 1 else 0.0)
    inner = gz * gy * gx
    tensor = [net.link(1, gx), net.link(gx, gy)]
    replicated = [net.link(gy * gx, gz), net.link(inner, gd * gc), *tensor]
    stage = gd * gc * inner
    ep = net.link(expert, stage // expert).time(ALL_REDUCE, experts) if expert > 1 else 0.0
    data = sum(lk.time(ALL_REDUCE, routers) for lk in replicated)
    return ep, data


@dataclass(frozen=True)
class MoEEstimate:
    """Predicted step of an MoE configuration on one rank (seconds).

    Attributes:
        step_s: step time; compute_s: compute (recompute and optimizer included);
            recompute_s: of which recomputation.
        exposed_s: exposed communication per axis (``expert``: the all-to-alls and the
            expert-sharded gradient sums; ``pipe``: point-to-point); comm_s: all of it.
        bubble_s: the pipeline bubble (0 without a pipeline).
        grad_accum: micro-batches per step.
        expert_compute_s: of ``compute_s``, the routed experts' and routers'.
        dense: the stand-in's estimate (:class:`tetrad.plan.step_time.Estimate` or
            :class:`tetrad.plan.pipe.pipeline_step.PipeEstimate`).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    bubble_s: float
    grad_accum: int
    expert_compute_s: float
    dense: object


def moe_estimate(
    ctx: StepQuestion,
    grid: tuple,
    micro_batch: int,
    checkpointing: str,
    expert: int,
    *,
    imbalance: float = 1.0,
    orientation: str = "xy",
    pipe: int = 1,
) -> MoEEstimate:
    """Predicted step of an MoE model (module doc) on the ``--grid`` ``grid = (G_data,
    [G_context,] G_z, G_y, G_x)`` (of ``world / pipe`` ranks) with ``expert = G_expert``
    (dividing the stage's ``G_data G_context G_z G_y G_x`` ranks and ``E``), ``pipe``
    pipeline stages (1F1B), ``micro_batch`` samples per (data, z) cell and ``checkpointing``
    ``none``, ``selective`` or ``full``. ``ctx`` is the MoE model's question (with
    :func:`tetrad.plan.question.sharded` for the sharded optimizer).

    Raises:
        PlanError: the batch does not split into micro-batches on this grid.
        tetrad.spec.pipeline_split.PipelineSplitError: more stages than blocks.
    """
    stand = stand_in_question(ctx)
    physical = with_context(grid)
    roles = role_sizes(physical, orientation)
    dense = dense_estimate(ctx, physical, micro_batch, checkpointing, orientation, pipe)
    bubble = dense.bubble_s if pipe > 1 else 0.0
    acc = dense.grad_accum
    ex = expert_times(ctx, stand, roles, micro_batch, expert, imbalance)
    full = parse_checkpointing(checkpointing) == "full"
    blocks = ctx.model.moe_layers  # the slowest stage's MoE blocks (a stage's are all MoE)
    if pipe > 1:
        blocks = max(r.blocks for r in moe_split(ctx, roles, micro_batch, checkpointing, pipe))
    per_block = ex.fwd + ex.bwd + (ex.fwd if full else 0.0)
    fake = ex.fake_ffn * (3 + (1 if full else 0)) * (ctx.model.n_layers if pipe == 1 else blocks)
    a2a = ex.a2a_fwd * (2 if full else 1) + ex.a2a_bwd
    a2a_total = ex.a2a_total_fwd * (2 if full else 1) + ex.a2a_total_bwd
    slots = acc + pipe - 1  # 1F1B: the stage's per-micro-batch time enters m + p - 1 times
    compute_mb = blocks * per_block - fake
    ep_total, data_sync = grad_sync_seconds(ctx, roles, expert, pipe)
    block_bwd = stand.compute(roles, micro_batch).block_bwd + ex.bwd + ex.a2a_bwd
    ep_sync = expert_sync_exposed(ctx, ep_total, blocks, block_bwd)
    # the routers' pieces over data x context, the routed experts' over expert-data (with the
    # sharded optimizer: tetrad/parallel/zero.py DataShards.experts), each as the dense ones
    data = data_group(physical) if shards_optimizer(ctx) else 1
    edp = expert_data_group(physical, expert) if data > 1 else 1
    per, hbm, pb = ctx.model.moe_layers / pipe, ctx.machine.hbm_bytes_per_s, ctx.param_bytes
    optimizer = optimizer_seconds(per * ctx.model.router_params(), hbm, data, pb)
    optimizer += optimizer_seconds(per * ctx.model.expert_params() / expert, hbm, edp, pb)
    exposed = dict(dense.exposed_s)
    comm = dict(dense.comm_s)
    exposed["expert"] = slots * blocks * a2a + ep_sync
    comm["expert"] = acc * blocks * a2a_total + ep_total
    exposed["data"] = exposed.get("data", 0.0) + data_sync
    comm["data"] = comm.get("data", 0.0) + data_sync
    compute = dense.compute_s + acc * compute_mb + optimizer
    recompute = dense.recompute_s + (acc * blocks * ex.fwd if full else 0.0)
    step = dense.step_s + slots * (compute_mb + blocks * a2a) + optimizer + ep_sync + data_sync
    if pipe > 1:
        bubble += (pipe - 1) * (compute_mb + blocks * a2a)
    expert_compute = acc * blocks * per_block + optimizer
    return MoEEstimate(step, compute, recompute, exposed, comm, bubble, acc, expert_compute, dense)


def moe_split(
    ctx: StepQuestion, roles: tuple, micro_batch: int, checkpointing: str, pipe: int
) -> tuple:
    """The stage split the runtime runs an MoE model with (1F1B, one stage per rank): as
    ``tetrad train`` splits with a machine (:func:`tetrad.plan.pipe.pipeline_step.
    planner_split`, by the planner's compute of the model's blocks, which counts each block as
    a dense one of ``ffn_dim``); memoised in ``ctx``."""
    memo = ctx.__dict__.setdefault("_moe_splits", {})
    key = (tuple(roles), micro_batch, checkpointing, pipe)
    got = memo.get(key)
    if got is None:
        costs = split_costs(ctx.compute(roles, micro_batch), checkpointing)
        got = memo[key] = split_ranks(ctx.model.n_layers, costs, pipe, 1)
    return got


def dense_estimate(
    ctx: StepQuestion, grid: tuple, micro_batch: int, checkpointing: str, turn: str, pipe: int
):
    """The stand-in's step (:func:`tetrad.plan.step_time.estimate`, with ``pipe > 1`` stages
    :func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate` under 1F1B on
    :func:`moe_split`'s stages), memoised in the stand-in's question: the expert axes of a
    grid share it. ``ctx``: the MoE model's question."""
    stand = stand_in_question(ctx)
    memo = stand.__dict__.setdefault("_dense_estimates", {})
    key = (grid, micro_batch, checkpointing, turn, pipe)
    got = memo.get(key)
    if got is None:
        if pipe > 1:
            ranks = moe_split(ctx, role_sizes(grid, turn), micro_batch, checkpointing, pipe)
            config = PipeConfig(pipe)
            got = pipeline_estimate(stand, config, grid, micro_batch, checkpointing, turn, ranks)
        else:
            got = estimate(stand, grid, micro_batch, checkpointing, orientation=turn)
        memo[key] = got
    return got


def stand_in_question(ctx: StepQuestion) -> StepQuestion:
    """The question of :func:`dense_stand_in` with ``ctx``'s machine, batch and options (and
    its sharded-optimizer flag), made once per ``ctx`` and kept in it."""
    memo = "_stand_in_sharded" if shards_optimizer(ctx) else "_stand_in"
    got = ctx.__dict__.get(memo)
    if got is None:
        # "all" lets the planner leave fine off where it does not pay (StepQuestion.fine)
        overlaps = "all" if ctx.fine[:1] == (0,) else sorted(ctx.overlaps)
        got = StepQuestion(
            dense_stand_in(ctx.model),
            ctx.machine,
            ctx.seq_len,
            ctx.global_batch,
            overlaps=overlaps,
            compute_bytes=ctx.c,
            param_bytes=ctx.param_bytes,
            bucket_bytes=ctx.bucket_bytes,
            domino_min_rows=ctx.domino_min_rows,
            fine_chunks=ctx.fine[0] if len(ctx.fine) == 1 else None,
            context_pieces=ctx.context_pieces,
        )
        if shards_optimizer(ctx):
            got = sharded(got)
        ctx.__dict__[memo] = got
    return got
