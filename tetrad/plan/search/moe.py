"""The search of ``tetrad plan`` (and ``--grid auto``) for a mixture-of-experts model: the 4D
space with the expert axis (:func:`search_moe_4d`) and the classic Megatron-style space with
MoE Parallel Folding (:func:`search_moe_classic`; Liu et al., "MoE Parallel Folding", arXiv
2504.14960: the experts laid out ``ETP x EP x EDP x PP`` over the ranks of ``TP x CP x DP x
PP``, here ``ETP = 1``).

4D space: every ``G_pipe`` dividing the GPUs (up to :data:`MAX_PIPE` and the blocks; 1F1B, one
stage per rank), every 5D grid of the rest that the MoE runtime runs
(:func:`tetrad.spec.sharding.moe_grid_problem`) with ``G_context G_y G_x`` within a node (the
tokens' splits: as Megatron keeps TP x CP in a node), every expert axis ``G_expert`` dividing
the stage's ``G_data G_context G_z G_y G_x`` ranks and ``E`` (folded over them innermost first,
as the runtime does: ``G_expert`` consecutive ranks hold ``E / G_expert`` experts each, never
replicated within the group), every micro-batch, checkpointing ``none``,
``selective`` and ``full``, and the sharded optimizer where only it fits. Memory from
:func:`tetrad.plan.memory.runtime.phase_totals` (with a pipeline
:func:`tetrad.plan.memory.pipeline.pipeline_memory`) at the 80% rule; the survivors are
timed best first by a compute floor (:func:`_floor`) with :func:`tetrad.plan.moe_step.
moe_estimate` until the floor passes the top-K's slowest.
"""

from __future__ import annotations

import heapq
import math
import time

from tetrad.plan.comm.context_parallel import local_seq_len
from tetrad.plan.comm.experts import all_to_all_seconds
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.plan.memory.activations import block_input_bytes
from tetrad.plan.memory.breakdown import FIT_FRACTION, MemoryBreakdown
from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.moe import moe_block_saved_bytes
from tetrad.plan.memory.pipeline import stage_memory
from tetrad.plan.memory.runtime import runtime_memory
from tetrad.plan.memory.states import (
    local_parameter_elements,
    optimizer_bytes_per_element,
    param_bytes,
)
from tetrad.plan.moe_step import (
    dense_stand_in,
    expert_times,
    grad_sync_seconds,
    moe_estimate,
    moe_split,
    stand_in_question,
)
from tetrad.plan.question import StepQuestion, sharded
from tetrad.plan.search.classic import classic_memory, megatron_estimate, pipeline_variants
from tetrad.plan.search.pipeline.floor_terms import FloorTerms
from tetrad.plan.search.rows import Row
from tetrad.plan.search.space import check_inputs, checkpointing_modes, divisors, factorizations
from tetrad.spec.activation_checkpointing import CHECKPOINTING
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import context_problems, grid_problems, moe_grid_problem, tp_problems
from tetrad.spec.units import FP32

MODES_BY_MEMORY = ("none", "selective", "full")
"""Checkpointing modes from the most memory to the least (what does not fit in one does not in
those before it)."""
MAX_PIPE = 16
"""The most pipeline stages the MoE search tries."""


def search_moe_4d(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[str | bool, ...] = CHECKPOINTING,
    micro_batches: tuple[int, ...] | None = None,
    overlaps="all",
    dtype: str = "bf16",
    gpu_memory_bytes: float | None = None,
    pipeline: bool = True,
    shard_optimizer: str = "auto",
    imbalance: float = 1.0,
    params: str = "fp32",
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting configurations of the 4D space with the expert axis (module
    doc) and counts (``grids``, ``candidates``, ``fitting``, ``evaluated``, ``seconds``).
    ``imbalance``: the busiest rank's routed rows over the mean (``>= 1``); ``params``: the
    weights' stored format (``tetrad train --param-dtype``: ``bf16`` with fp32 masters among
    the AdamW states, sharded with them; no bf16 copies of the weights saved for backward).

    Raises:
        PlanError: bad inputs, or no grid of ``gpus`` runs the model.
    """
    check_inputs(model, gpus, global_batch, seq_len)
    if imbalance < 1:
        raise PlanError(f"--moe-imbalance {imbalance} must be at least 1 (busiest over mean)")
    t0 = time.perf_counter()
    mem = float(gpu_memory_bytes or machine.memory_bytes)
    limit = FIT_FRACTION * mem
    ctx = StepQuestion(
        model,
        machine,
        seq_len,
        global_batch,
        overlaps=overlaps,
        compute_bytes=dtype_bytes(dtype),
        param_bytes=param_bytes(params),
    )
    modes = checkpointing_modes(checkpointing)
    allowed = set(micro_batches) if micro_batches else None
    stats = dict.fromkeys(("grids", "candidates", "fitting", "evaluated"), 0)
    queue: list = []
    pipes = [p for p in divisors(gpus) if p <= min(MAX_PIPE, model.n_layers)]
    for cand in _candidates(ctx, gpus, pipes if pipeline else [1], limit, shard_optimizer, stats):
        states = _states_floor(model, *cand, shard_optimizer, params)
        for mode, b in _choices(ctx, cand[0], cand[1], modes, allowed):
            if states + _saved_floor(ctx, *cand, b, mode, imbalance) > limit:
                continue
            stats["candidates"] += 1
            full = (*cand, b, mode)
            heapq.heappush(queue, (_floor(ctx, *full, imbalance), stats["candidates"], full))
    best: list = []  # max-heap of (-step, -n, row)
    too_big: dict = {}  # (pipe, grid, expert, mode) -> the smallest micro-batch that did not fit
    while queue:
        floor, n, cand = heapq.heappop(queue)
        if len(best) >= top and floor >= -best[0][0]:
            break
        pipe, grid, ep, b, mode = cand
        if b >= too_big.get((pipe, grid, ep, mode), math.inf):
            continue  # memory grows with the micro-batch, and with less recomputation
        fit = _fit(ctx, cand, limit, mem, dtype, shard_optimizer, imbalance)
        if fit is None:  # nor with less recomputation, nor with fewer experts' ranks (2 or more)
            smaller = [e for e in divisors(ep) if e > 1] or [ep]
            for more in MODES_BY_MEMORY[: MODES_BY_MEMORY.index(mode) + 1]:
                for e in smaller:
                    key = (pipe, grid, e, more)
                    too_big[key] = min(b, too_big.get(key, math.inf))
            continue
        stats["fitting"] += 1
        row = _row(ctx, (*cand, *fit), imbalance, machine, gpus, global_batch, seq_len)
        stats["evaluated"] += 1
        heapq.heappush(best, (-row.step_s, -n, row))
        if len(best) > top:
            heapq.heappop(best)
    if not best:
        raise PlanError(
            f"no configuration of {model.name} fits in 80% of {mem / 2**30:.1f} GiB on {gpus} "
            "GPUs: raise --gpus or take a machine with more memory"
        )
    rows = sorted((r for _, _, r in best), key=lambda r: r.step_s)
    stats["seconds"] = time.perf_counter() - t0
    return rows, stats


def _candidates(ctx, gpus, pipes, limit, shard_optimizer, stats):
    """``(pipe, grid, expert)`` of every pipeline size, 5D grid and expert axis the MoE
    runtime runs (module doc) whose model states alone may fit (:func:`_states_floor`)."""
    model, seq_len = ctx.model, ctx.seq_len
    for pipe in pipes:
        for grid in factorizations(gpus // pipe, 5):
            gd, gc, gz, gy, gx = grid
            if gc * gy * gx > ctx.machine.gpus_per_node or context_problems(seq_len, gc):
                continue
            if ctx.global_batch % (gd * gz) or grid_problems(model, (gd, gz, gy, gx)):
                continue
            if moe_grid_problem(model, grid, pipe, 1, seq_len):
                continue
            stats["grids"] += 1
            for ep in divisors(math.gcd(gpus // pipe, model.n_experts)):
                if _states_floor(model, pipe, grid, ep, shard_optimizer, _weights(ctx)) <= limit:
                    yield pipe, grid, ep


def _weights(ctx: StepQuestion) -> str:
    """The weights' stored format of a question (``bf16`` where it stores 2 bytes each)."""
    return "bf16" if ctx.param_bytes == 2 else "fp32"


def _states_floor(
    model: ModelSpec, pipe: int, grid: tuple, ep: int, shard: str, params: str = "fp32"
) -> float:
    """A lower bound of the fullest rank's model states (bytes) for a grid and expert axis:
    the weights (in ``params``), fp32 gradients and AdamW states (with bf16 weights their fp32
    masters) of ``ceil(L / pipe)`` blocks' local elements (the states of the non-expert ones
    over ``G_data G_context`` and of the experts over their expert-data group when the
    optimizer may be sharded; an MoE model's pipeline stages hold MoE blocks only,
    :func:`tetrad.plan.memory.pipeline.stage_model`)."""
    gd, gc, gz, gy, gx = grid
    n = local_parameter_elements(model, grid, ep)
    tables = (model.vocab_size + model.max_positions) * model.dim // (gz * gy * gx)
    blocks = n["matrices"] - tables - (0 if model.tied_embeddings else tables)
    share = math.ceil(model.n_layers / pipe) / model.n_layers  # the fullest stage's blocks
    rest = (blocks + n["vectors"]) * share
    zero = shard != "off" and gd * gc > 1
    stored, states = param_bytes(params) + FP32, optimizer_bytes_per_element(params)
    per = stored + (states / (gd * gc) if zero else states)
    edp = gd * gc * gz * gy * gx // ep  # the experts' expert-data group
    per_expert = stored + (states / edp if zero else states)
    return per * rest + per_expert * n["experts"] * share


def _saved_floor(ctx, pipe, grid, ep, b, mode, imbalance) -> float:
    """A lower bound of the activations the fullest rank keeps for backward (bytes): per MoE
    block and micro-batch in flight, what its routed experts, router, dispatch and combine
    save (:func:`tetrad.plan.memory.moe.moe_block_saved_bytes`: the bf16 expert-weight copies
    among them), or under ``full`` checkpointing the block's input
    (:func:`tetrad.plan.memory.activations.block_input_bytes`); on the pipeline rank with the
    most (rank ``r`` of :func:`tetrad.plan.moe_step.moe_split`'s stages holds ``min(m, p -
    r)`` micro-batches in flight under 1F1B)."""
    model = ctx.model
    gd, gc, gz, gy, gx = grid
    s = local_seq_len(ctx.seq_len, gc)
    if mode == "full":
        per_block = block_input_bytes(model, grid, b, s, 1, ctx.c)
    else:
        split = gc * gy * gx > 1
        args = (model, b * s, b, gy, gx, ctx.c, mode, ep, imbalance, split, _weights(ctx))
        per_block = moe_block_saved_bytes(*args)
    if pipe == 1:
        return float(model.moe_layers * per_block)
    acc = ctx.global_batch // (grid[0] * grid[2] * b)
    ranks = moe_split(ctx, grid, b, mode, pipe)
    return float(max(min(acc, pipe - r.rank) * r.blocks for r in ranks) * per_block)


def _choices(ctx, pipe, grid, modes, allowed):
    """``(mode, micro-batch)`` of one grid: every mode, every micro-batch dividing a (data, z)
    cell's samples that splits the positions over the tensor ranks (and, with a pipeline, at
    least ``pipe`` micro-batches per step)."""
    gd, gc, gz, gy, gx = grid
    per_cell = ctx.global_batch // (gd * gz)
    for mode in modes:
        for b in divisors(per_cell):
            if allowed is not None and b not in allowed:
                continue
            if gy * gx > 1 and (b * ctx.seq_len // gc) % (gy * gx):
                continue
            if pipe > 1 and per_cell // b < pipe:
                continue
            yield mode, b


def _variants(grid: tuple, shard_optimizer: str) -> tuple[bool, ...]:
    """The optimizer variants of a grid, in the order :func:`_fit` tries them: the sharded
    one only where the plain one does not fit (``auto``), and only with a data x context
    group to shard over."""
    if grid[0] * grid[1] == 1:
        return (False,)
    return {"off": (False,), "on": (True,), "auto": (False, True)}[shard_optimizer]


def _fit(ctx, cand, limit, mem, dtype, shard_optimizer, imbalance):
    """``(sharded, memory)`` of the first optimizer variant of a configuration that fits (the
    sharded one only where the plain one does not, ``shard_optimizer="auto"``), else None."""
    pipe, grid, ep, b, mode = cand
    acc = ctx.global_batch // (grid[0] * grid[2] * b)
    for zero in _variants(grid, shard_optimizer):
        m = _memory(ctx, pipe, grid, ep, b, mode, dtype, zero, imbalance, mem, acc)
        if m.total <= limit:
            return zero, m
    return None


def _memory(ctx, pipe, grid, ep, b, mode, dtype, zero, imbalance, mem, acc) -> MemoryBreakdown:
    """The worst rank's memory of one configuration (with a pipeline: its first, second and
    last ranks under 1F1B with ``acc`` micro-batches, split by the stand-in's compute as
    :func:`moe_estimate` times it)."""
    model = ctx.model
    opts = {"expert": ep, "imbalance": imbalance, "shard_optimizer": zero, "dtype": dtype}
    if _weights(ctx) != "fp32":
        opts["params"] = _weights(ctx)
    if pipe == 1:
        return runtime_memory(
            model, grid, b, ctx.seq_len, mem, activation_checkpointing=mode, **opts
        )
    ranks = moe_split(ctx, grid, b, mode, pipe)
    # under 1F1B rank r holds p - r micro-batches in flight: the peak is on the first rank,
    # the first with the most blocks or the last (the LM head's logits)
    most = max(ranks, key=lambda r: (r.blocks, -r.rank))
    peaks = {r.rank: r for r in (ranks[0], ranks[1], most, ranks[-1])}.values()
    mems = [
        stage_memory(
            model,
            grid,
            b,
            ctx.seq_len,
            mem,
            r,
            "1f1b",
            pipe,
            acc,
            activation_checkpointing=mode,
            **opts,
        )
        for r in peaks
    ]
    return max(mems, key=lambda m: m.total)


def _floor(ctx, pipe, grid, ep, b, mode, imbalance) -> float:
    """A lower bound of the step of a configuration (seconds): per micro-batch, the stand-in's
    compute (memoised per shape; with a pipeline, the fullest stage's blocks only) and the
    routed experts' compute and blocking all-to-alls (under ``full`` checkpointing their
    forward twice), over ``m`` micro-batches (1F1B on ``p`` stages: ``m + p - 1`` of the
    slowest stage's), the stand-in's exposed collectives of ``m`` micro-batches at least
    (:func:`_comm_floor`), and the per-step gradient sums the stand-in lacks (the experts' at
    least one block's share where they overlap backward:
    :func:`tetrad.plan.moe_step.expert_sync_exposed`)."""
    gd, gc, gz, gy, gx = grid
    acc = ctx.global_batch // (gd * gz * b)
    stand = stand_in_question(ctx)
    memo = ctx.__dict__.setdefault("_moe_floor_memo", {})
    key = (pipe, grid, ep, b, imbalance)
    got = memo.get(key)
    if got is None:  # the same for every checkpointing mode
        ex = expert_times(ctx, stand, grid, b, ep, imbalance)
        expert = ex.fwd + ex.bwd + ex.a2a_fwd + ex.a2a_bwd - 3 * ex.fake_ffn
        again = ex.fwd + ex.a2a_fwd - ex.fake_ffn  # full recomputation's forward once more
        got = memo[key] = (expert, again, *grad_sync_seconds(ctx, grid, ep, pipe))
    expert, again, ep_sync, data_sync = got
    overlapped = "dp_all_reduce" in ctx.overlaps
    if mode == "full":
        expert += again
    if pipe == 1:
        f, bw, r = stand.micro_batch_seconds(grid, b, mode)
        comm = _comm_floor(ctx, pipe, grid, b, mode, ctx.model.n_layers)
        sync = data_sync + (ep_sync / ctx.model.moe_layers if overlapped else ep_sync)
        return acc * (f + bw + r + ctx.model.moe_layers * expert + comm) + sync
    comp = stand.compute(grid, b)
    rec = {"full": comp.block_fwd, "selective": comp.selective}.get(mode, 0.0)
    blocks = max(r.blocks for r in moe_split(ctx, grid, b, mode, pipe))
    stage = blocks * (comp.block_fwd + comp.block_bwd + rec + expert)
    sync = data_sync + (ep_sync / blocks if overlapped else ep_sync)
    return (acc + pipe - 1) * stage + acc * _comm_floor(ctx, pipe, grid, b, mode, blocks) + sync


def _comm_floor(ctx, pipe, grid, b, mode, blocks) -> float:
    """The stand-in's exposed collectives per micro-batch on a rank of ``blocks`` blocks at
    least (seconds): each block's context K/V and X/Y collectives, and the Z seconds its
    windows cannot hide (:class:`tetrad.plan.search.pipeline.floor_terms.FloorTerms`, whose
    terms are at most what the estimates count)."""
    gd, gc, gz, gy, gx = grid
    terms = ctx.__dict__.get("_moe_floor_terms")
    if terms is None:
        gpus = pipe * gd * gc * gz * gy * gx
        terms = ctx.__dict__["_moe_floor_terms"] = FloorTerms(stand_in_question(ctx), gpus)
    full = mode == "full"
    kv = terms.kv_seconds(gc, gz, gy, gx, b, full) if gc > 1 else 0.0
    xy = terms.xy_seconds(grid, b, mode, "xy")
    z_block, z_ends = terms.z_floor(grid, b, full)
    return blocks * (kv + xy) + max(0.0, blocks * z_block - z_ends)


def _row(ctx, cand, imbalance, machine, gpus, global_batch, seq_len) -> Row:
    """The ranked row of one configuration, timed by :func:`moe_estimate`."""
    pipe, grid, ep, b, mode, zero, mem = cand  # noqa: F841 (mem: the row's)
    q = sharded(ctx) if zero else ctx
    est = moe_estimate(q, grid, b, mode, ep, imbalance=imbalance, pipe=pipe)
    gd, gc, gz, gy, gx = grid
    other = {"pipeline_bubble": est.bubble_s} if pipe > 1 else {}
    return Row(
        "4d",
        {"data": gd, "context": gc, "z": gz, "y": gy, "x": gx},
        b,
        est.grad_accum,
        mode,
        est.step_s,
        est.compute_s,
        est.recompute_s,
        est.exposed_s,
        est.comm_s,
        0.0,
        0.0,
        mem,
        "tetrad",
        other,
        pipe=pipe,
        schedule="1f1b" if pipe > 1 else "",
        shard_optimizer=zero,
        expert=ep,
    ).finish(ctx.model, machine, gpus, global_batch, seq_len)


def search_moe_classic(
    model: ModelSpec,
    machine: Machine,
    gpus: int,
    global_batch: int,
    seq_len: int,
    *,
    top: int = 10,
    checkpointing: tuple[str | bool, ...] = CHECKPOINTING,
    micro_batches: tuple[int, ...] | None = None,
    gpu_memory_bytes: float | None = None,
    imbalance: float = 1.0,
) -> tuple[list[Row], dict]:
    """The ``top`` fastest fitting Megatron-style configurations of an MoE model: ``TP x CP x
    PP x DP`` as :mod:`tetrad.plan.search.classic` (1F1B, even or uneven splits) with the
    experts folded ``EP x EDP`` (``ETP = 1``) over the ``TP CP DP`` ranks of a stage, ``EP``
    dividing them and ``E``, EP innermost (consecutive ranks: in a node where it fits).

    Memory: :func:`tetrad.plan.search.classic.classic_memory` of the dense stand-in
    (:func:`tetrad.plan.moe_step.dense_stand_in`), plus the stage's routed experts (bf16
    weights, fp32 gradients, the distributed optimizer's 12 bytes over ``EDP``: ``6 + 12 /
    EDP`` bytes each) and their activations (per MoE layer ``R (h + 4 f_e) c`` rows and
    intermediates and ``T k h (4 + c)`` dispatch and combine, ``T = b S / (CP TP)``: sequence
    parallelism gives each TP rank its own tokens; all layers of the stage in flight as
    Fujii's factor says, one under full recomputation). Time:
    :func:`tetrad.plan.search.classic.megatron_estimate` of the stand-in plus the experts'
    compute and blocking all-to-alls per layer and micro-batch (over ``EP`` consecutive ranks),
    the expert gradients' reduce-scatter and parameter all-gather over ``EDP`` (overlapped as
    the dense ones), the 1F1B bubble.

    Raises:
        PlanError: bad inputs.
    """
    check_inputs(model, gpus, global_batch, seq_len)
    t0 = time.perf_counter()
    mem_bytes = float(gpu_memory_bytes or machine.memory_bytes)
    stand = dense_stand_in(model)
    allowed = set(micro_batches) if micro_batches else None
    modes = tuple(c for c in checkpointing_modes(checkpointing) if c != "selective") or ("full",)
    stats = {"configs": 0, "fitting": 0}
    ctx = StepQuestion(model, machine, seq_len, global_batch)
    rows: list[Row] = []
    for tp in divisors(gpus):
        if tp > machine.gpus_per_node or tp_problems(stand, tp):
            continue
        for cp in divisors(gpus // tp):
            if tp * cp > machine.gpus_per_node or context_problems(seq_len, cp):
                continue
            for pp in divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if global_batch % dp or pp > model.n_layers:
                    continue
                for _v, layers in pipeline_variants(model.n_layers, pp, False, True):
                    for ep in divisors(math.gcd(tp * cp * dp, model.n_experts)):
                        for ckpt in modes:
                            rows += _classic_rows(
                                ctx,
                                stand,
                                (tp, cp, pp, dp, ep),
                                layers,
                                ckpt,
                                mem_bytes,
                                allowed,
                                stats,
                                imbalance,
                                gpus,
                            )
    rows.sort(key=lambda r: r.step_s)
    stats["seconds"] = time.perf_counter() - t0
    return rows[:top], stats


def _classic_rows(
    ctx, stand, sizes, layers, ckpt, mem_bytes, allowed, stats, imbalance, gpus
) -> list[Row]:
    """The fitting rows of one folded grid and mode, micro-batches ascending until one does
    not fit."""
    model, machine = ctx.model, ctx.machine
    tp, cp, pp, dp, ep = sizes
    seq, batch = ctx.seq_len, ctx.global_batch
    edp = tp * cp * dp // ep
    stage_layers = max(layers) if layers else model.n_layers // pp
    moe_layers = model.moe_layers * stage_layers / model.n_layers
    local = moe_layers * model.expert_params() / ep
    full = ckpt == "full"
    out = []
    for b in divisors(batch // dp):
        if allowed is not None and b not in allowed:
            continue
        acc = batch // (dp * b)
        stats["configs"] += 1
        mem = classic_memory(stand, tp, cp, pp, dp, b, seq, mem_bytes, acc, ckpt, 1, layers)
        t = b * seq / (cp * tp)
        rows = t * model.top_k * (imbalance if ep > 1 else 1.0)
        per_layer = 2 * rows * (model.dim + 4 * model.expert_dim) + t * model.top_k * model.dim * 6
        factor = min(1.0, acc / pp) if pp > 1 else 1.0  # Fujii's: the first stage's
        act = per_layer if full else model.moe_layers * per_layer * factor
        mem.components["expert_states"] = (6.0 + 12.0 / edp) * local
        mem.components["expert_activations"] = act
        if not mem.fits:
            break
        stats["fitting"] += 1
        est = megatron_estimate(stand, machine, tp, cp, pp, dp, b, seq, batch, ckpt, 1, layers)
        # each TP rank routes its own b S / (CP TP) tokens (sequence parallelism), the
        # all-to-alls over EP consecutive ranks (stride 1), not expert_times' tetrad group
        ex = expert_times(
            ctx, stand_in_question(ctx), (1, cp, 1, tp, 1), b, ep, imbalance, pieces=1
        )
        blocks = math.ceil(moe_layers)
        a2a = 0.0
        if ep > 1:
            sent = t * model.top_k * model.dim * 2 * (ep - 1) / ep * imbalance
            row = all_to_all_seconds(machine.network, 1, ep, sent)
            a2a = (4 + (2 if full else 0)) * row
        fake = ex.fake_ffn * (3 + (1 if full else 0)) * stage_layers
        extra = blocks * (ex.fwd + ex.bwd + (ex.fwd if full else 0.0) + a2a) - fake
        step = est["step_s"] + (acc + pp - 1) * extra
        exposed = dict(est["exposed"])
        exposed["ep"] = (acc + pp - 1) * blocks * a2a
        if edp > 1:
            link = machine.network.link(ep, edp)
            rs, ag = link.time(REDUCE_SCATTER, 4 * local), link.time(ALL_GATHER, 2 * local)
            t_b = blocks * ex.bwd
            sync = max(0.0, rs - t_b) + max(0.0, ag - blocks * ex.fwd)
            exposed["dp"] = exposed.get("dp", 0.0) + sync
            step += sync
        compute = est["compute_s"] + acc * (blocks * (ex.fwd + ex.bwd + ex.fwd * full) - fake)
        other = {"pipeline_bubble": est["bubble_s"] + (pp - 1) * extra}
        if layers:
            other["stage_layers"] = list(layers)
        out.append(
            Row(
                "classic",
                {"tp": tp, "cp": cp, "pp": pp, "dp": dp},
                b,
                acc,
                ckpt,
                step,
                compute,
                est["recompute_s"],
                exposed,
                dict(est["comm"]) | {"ep": acc * blocks * a2a},
                0.0,
                0.0,
                mem,
                "megatron",
                other,
                expert=ep,
            ).finish(model, machine, gpus, batch, seq)
        )
    return out
