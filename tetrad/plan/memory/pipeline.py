"""Per-GPU memory of a pipeline grid ``(G_pipe, G_data, G_context, G_z, G_y, G_x)``: every pipeline
rank's :func:`tetrad.plan.memory.runtime.runtime_memory` estimate for its own blocks, with the
micro-batches its schedule keeps in flight (:func:`pipeline_memory`); the worst rank decides the fit
(80% of GPU memory, Fujii et al., arXiv 2411.06465). Plain Python, bytes.

Per pipeline rank ``r`` holding ``k`` blocks over its ``v`` stages
(:class:`tetrad.plan.pipe.stages.PipeRank`):

- parameters, gradients and AdamW states (16 bytes per local element; 8 + 8 / (G_data
  G_context) with the sharded optimizer; with bf16 weights 2 + 4 + 12, the fp32 masters with
  the states, :func:`tetrad.plan.memory.sharded_optimizer.state_bytes_per_element`) of its
  blocks, plus the
  embedding tables on the rank of stage 0 and the final norm and LM head on the rank of the last
  stage (a tied head is counted as the embedding's copy there);
- every phase of the runtime's model on a ``k``-block model; the LM head's two phases only on
  the last stage's rank, the embedding's saved input only on stage 0's;
- in every phase up to the end of backward, the saved activations of the chunk passes (one
  micro-batch through one stage) its schedule keeps in flight at its peak, in place of that one
  micro-batch's (:func:`in_flight_bytes`): per pass its stage's blocks' saved tensors (with the
  positions each stage's forward builds; the context masks once per stage, which its attention
  caches), the embedding's on stage 0, the final norm's and the LM head's saved weight gradient
  on the last stage. Which passes are in flight: GPipe all ``m``; 1F1B ``min(m, p - r)`` of its
  one stage (:func:`tetrad.plan.pipe.schedule.in_flight_chunks`); interleaved 1F1B torch's order
  played out (:func:`in_flight_sets`), whose most passes are that count too. The head's weight
  gradient is counted in the runtime model's ``logits_and_loss`` for the current micro-batch
  and in ``activations`` for the others (GPipe's last rank holds one per micro-batch), where
  ``G_z > 1`` keeps one (with ``G_z = 1`` training puts it into the gradient in forward);
- ``pipeline_buffers`` (``p > 1``): the live receive buffers, ``[b, S/G_context, h/G_x]`` in
  the compute dtype, each allocated when its receive is posted and dropped after its
  micro-batch's backward (:class:`tetrad.pipeline.stage.TetradStage`; torch alone would keep
  one per micro-batch, stage and direction for the whole run): the in-flight passes' inputs
  and one posted ahead per stage and direction; and up to the end of backward each in-flight
  pass's stage output, which the stage keeps for its backward (:func:`in_flight_bytes`).

Checked against the runtime on gloo ranks (tests/test_pipeline_memory.py): model states, saved
activations at the peak to the byte; receive buffers and held outputs never above the planner's,
below it by at most the receives it counts as posted ahead. (One exception, gloo's own: under
GPipe and 1F1B a gloo stage posts all of a step's receives of a direction at its first pass, up
to ``m - 1`` boundary tensors per direction more than modelled;
:class:`tetrad.torch_private.LeanRecvStage`.)

What each rank adjusts comes from the runtime model's parts of one stage, a model of ``k``
blocks (:func:`stage_parts`, :func:`stage_saved`), and the tables a stage holds or drops
(:func:`table_elements`), each memoised: the ranks of a pipeline, and the pipelines of a
search, share them.
"""

from __future__ import annotations

import functools
import operator

from tetrad.plan.errors import PlanError
from tetrad.plan.memory import sharded_optimizer
from tetrad.plan.memory.activations import context_shared_bytes, saved_activations
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.plan.memory.buffers import step_buffer_bytes
from tetrad.plan.memory.formats import dtype_bytes, residual_bytes
from tetrad.plan.memory.runtime import phase_components
from tetrad.plan.memory.sharded_optimizer import data_group, state_share
from tetrad.plan.memory.states import optimizer_bytes_per_element, param_bytes
from tetrad.plan.pipe.schedule import (
    boundaries_of_rank,
    in_flight_chunks,
    p2p_bytes,
)
from tetrad.plan.pipe.stages import PipeRank, stage_model
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import ModelSpec

HEAD_PHASES = ("forward: LM head", "backward: LM head")
"""The runtime model's phases that exist only on the rank of the last stage."""
ENDS = ("backward: end", "optimizer step")
"""Phases after the last micro-batch's backward: no other micro-batch is in flight."""


def table_elements(model: ModelSpec, grid) -> tuple[int, int, int]:
    """``(embedding, LM head, final norm)`` local elements, as :mod:`tetrad.plan.memory.states`
    counts them (``n k / (G_x G_y G_z)`` per table, ``h / G_x`` for the norm)."""
    _, gz, gy, gx = grid_sizes(grid)
    shard = gx * gy * gz
    emb = model.vocab_size * model.dim // shard
    if model.max_positions:
        emb += model.max_positions * model.dim // shard
    head = model.vocab_size * model.dim // shard
    return emb, head, model.norm_params() // gx


@functools.lru_cache(maxsize=1 << 14)
def stage_parts(
    model: ModelSpec,
    blocks: int,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt: str,
    dtype: str,
    prefetch: bool,
    shard_optimizer: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    *,
    sequence_parallel: bool = False,
    residual: str | None = None,
) -> tuple:
    """The runtime model's static components, phases and saved activations of a ``blocks``
    model (memoised: the ranks of a pipeline share them); ``shard_optimizer``, ``expert``,
    ``imbalance``, ``params``, ``sequence_parallel`` and ``residual``: as
    :func:`tetrad.plan.memory.runtime.runtime_memory`'s.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    sm = stage_model(model, blocks)
    opts = {"activation_checkpointing": ckpt, "dtype": dtype}
    if model.n_experts:
        opts |= {"expert": expert, "imbalance": imbalance}
    zero = {"shard_optimizer": shard_optimizer}
    if params != "fp32":
        zero["params"] = params
    if sequence_parallel:  # True, or "regather"
        opts |= {"sequence_parallel": sequence_parallel}
    if residual is not None:
        opts |= {"residual": residual}
    static, phases = phase_components(
        sm, grid, micro_batch, seq_len, prefetch=prefetch, **zero, **opts
    )
    moe_params = {"params": params} if model.n_experts and params != "fp32" else {}
    saved = saved_activations(sm, grid, micro_batch, seq_len, **opts, **moe_params)
    return static, phases, saved


MOE_OPTS_WITH_PARAMS = 6
"""Length of an MoE model's ``opts`` (:func:`_parts_args`) that carries its weights' format:
``(checkpointing, dtype, prefetch, expert, imbalance, params)``."""


def _params_arg(params: str, opts: tuple = ()) -> dict:
    """``params`` as :func:`stage_parts`' keyword, absent for fp32 weights (the memo's key of
    the callers that never give it) and where ``opts`` carries it already (an MoE model's,
    whose saved activations depend on it: :func:`stage_memory`)."""
    carried = len(opts) == MOE_OPTS_WITH_PARAMS
    return {} if params == "fp32" or carried else {"params": params}


def _activation_args(sp: bool | str, residual: str | None) -> dict:
    """The keywords of :func:`stage_parts` and :func:`stage_saved` for sequence parallelism
    and the residual stream's format, absent at their defaults (the memos' keys of the callers
    that never give them)."""
    more: dict = {"sequence_parallel": sp} if sp else {}
    return more if residual is None else more | {"residual": residual}


def _parts_args(opts: tuple, shard_optimizer: bool | None = None) -> tuple:
    """The arguments of :func:`stage_parts` after the sequence length for ``opts`` =
    ``(checkpointing, dtype, prefetch)`` (an MoE model's with ``(expert, imbalance)`` after,
    and its weights' format where not fp32),
    spelled as the dense model's callers always have (its memo's keys)."""
    if shard_optimizer is None and len(opts) == 3:
        return opts
    return (*opts[:3], bool(shard_optimizer), *opts[3:])


@functools.lru_cache(maxsize=1 << 14)
def stage_saved(
    model: ModelSpec,
    blocks: int,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt,
    dtype,
    *moe: float,
    sequence_parallel: bool = False,
    residual: str | None = None,
) -> dict[str, float]:
    """:func:`~tetrad.plan.memory.activations.saved_activations` of a ``blocks`` model (one
    stage), memoised; ``moe``: an MoE model's ``(expert, imbalance[, params])``."""
    sm = stage_model(model, blocks)
    opts = dict(zip(("expert", "imbalance", "params"), moe, strict=False))
    if sequence_parallel:
        opts["sequence_parallel"] = sequence_parallel
    if residual is not None:
        opts["residual"] = residual
    return saved_activations(
        sm, grid, micro_batch, seq_len, activation_checkpointing=ckpt, dtype=dtype, **opts
    )


def interleaved_order(pipe: int, rank: int, virtual: int, micro_batches: int):
    """``(forward, k)`` for each chunk pass of pipeline rank ``rank`` under torch's
    ``ScheduleInterleaved1F1B`` (``_get_1f1b_rank_ops``), in execution order: ``k`` is the
    rank's local stage (``0 .. v - 1``); rounds of ``m / max(1, m // p)`` micro-batches, warm-up
    ``min((v - 1) per_round + 2 (p - 1 - r), m v)`` forwards, then one forward and one backward
    per step (forwards in stage order, backwards from the last local stage), then the rest of
    the backwards."""
    per = micro_batches // max(1, micro_batches // pipe)
    total = micro_batches * virtual
    warmup = min((virtual - 1) * per + 2 * (pipe - 1 - rank), total)
    for step in range(total + warmup):
        if step < total:
            yield True, (step // per) % virtual
        if step >= warmup:
            yield False, virtual - 1 - ((step - warmup) // per) % virtual


@functools.lru_cache(maxsize=1 << 12)
def in_flight_sets(
    schedule: str, pipe: int, rank: int, virtual: int, micro_batches: int
) -> tuple[tuple[int, ...], ...]:
    """The micro-batches in flight per local stage of pipeline rank ``rank`` (``c[k]`` for its
    ``k``-th stage, execution order) after each of its forward chunk passes, the sets that no
    other set covers (any of them can be the peak, whatever the stages' sizes). GPipe holds
    all ``m`` of every stage, 1F1B (one stage) ``min(m, p - r)``: both
    :func:`tetrad.plan.pipe.schedule.in_flight_chunks`; interleaved 1F1B is played out
    (:func:`interleaved_order`; its largest total is ``in_flight_chunks``) up to the first
    period of its steady phase: from the end of the warm-up, any ``P = per_round v``
    consecutive steps run a forward and a backward of every local stage ``per_round`` times
    each, so the counts after a steady forward repeat every ``P`` steps and the later forwards
    add no new set."""
    if schedule != "interleaved-1f1b":
        n = in_flight_chunks(schedule, pipe, rank, virtual, micro_batches)
        return ((n // virtual,) * virtual,)
    per = micro_batches // max(1, micro_batches // pipe)
    total = micro_batches * virtual
    warmup = min((virtual - 1) * per + 2 * (pipe - 1 - rank), total)
    stop = min(total, warmup + per * virtual)  # forwards up to the first steady period's end
    counts, seen, forwards = [0] * virtual, set(), 0
    for forward, k in interleaved_order(pipe, rank, virtual, micro_batches):
        counts[k] += 1 if forward else -1
        if forward:
            seen.add(tuple(counts))
            forwards += 1
            if forwards == stop:
                break
    # the warm-up's sets grow into the first steady one; after each steady forward the rank
    # holds the most passes: those sets cover all others (and none covers another)
    most = max(map(sum, seen))
    return tuple(sorted(c for c in seen if sum(c) == most))


def _chunks(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    layout: tuple,
    opts: tuple,
    sp: bool = False,
    residual: str | None = None,
) -> tuple[list[float], list[float], float]:
    """``(saved, held, out)``: for one micro-batch through each of the rank's stages (execution
    order), the bytes autograd saves (its blocks', with the embedding's on stage 0 and the final
    norm's and the LM head's on the last stage) and those the schedule holds besides until the
    pass's backward (``layout``: the rank's ``(blocks, first, last, chunk_blocks)``); ``out``
    is one boundary tensor ``[b, S/G_context, h/G_x]`` in the compute dtype (what crosses a
    stage boundary).

    Held: the stage's output, kept in the stage's forward cache. With the residual stream in
    the compute dtype (no cast at the boundaries: fp32, or bf16 by default) a later stage's
    input receive buffer is the very tensor its first block saves, counted among the receive
    buffers (:func:`in_flight_bytes`) and in the saved bytes, and its output is the next
    stage's tensor, not saved here: the two cancel, so only stage 0 holds ``out``. With an
    fp32 stream under bf16 compute (``residual="fp32"``) the received input is cast to fp32
    (the copy is what is saved) and the output cast to bf16: every stage but the last holds
    its ``out``. ``sp``: sequence parallelism (``out`` is ``[b, S/(G_context G_y), h]``)."""
    _, _, gy, gx = grid_sizes(grid)
    out = p2p_bytes(
        micro_batch,
        seq_len,
        model.dim,
        context_size(grid),
        gx,
        dtype_bytes(opts[1]),
        gy if sp else 1,
    )
    more = _activation_args(sp, residual)
    rank_blocks, rank_first, rank_last, chunk_blocks = layout
    v = len(chunk_blocks)
    cast = residual_bytes(opts[1], residual) != dtype_bytes(opts[1])
    saved, held = [], []
    for k, blocks in enumerate(chunk_blocks):
        if blocks == rank_blocks:  # one stage: the rank model's (memoised with its phases)
            args = _parts_args(opts)
            s = stage_parts(model, blocks, grid, micro_batch, seq_len, *args, **more)[2]
        else:
            args = (*opts[:2], *opts[3:])
            s = stage_saved(model, blocks, grid, micro_batch, seq_len, *args, **more)
        first, last = rank_first and k == 0, rank_last and k == v - 1
        ends = (s["embedding"] if first else 0.0) + (s["final_norm"] + s["loss"] if last else 0.0)
        saved.append(s["blocks"] + ends)
        held.append(out if first or (cast and not last) else 0.0)
    return saved, held, out


def in_flight_bytes(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    prank: PipeRank,
    schedule: str,
    pipe: int,
    micro_batches: int,
    opts: tuple,
    sp: bool = False,
    residual: str | None = None,
) -> tuple[float, float, float]:
    """``(saved, held, persistent)`` bytes of pipeline rank ``prank`` at its peak: the saved
    tensors of the chunk passes in flight (:func:`in_flight_sets`, the set with the most bytes),
    what the schedule holds besides for them (:func:`_chunks`), and the live receive buffers,
    ``[b, S/G_context, h/G_x]`` in the compute dtype each: :class:`tetrad.pipeline.stage.
    TetradStage` allocates one when its receive is posted and drops it after its micro-batch's
    backward, so they are the inputs of the passes in flight on stages other than stage 0 and
    one receive posted ahead per stage and direction the rank receives in
    (:func:`tetrad.plan.pipe.schedule.boundaries_of_rank`; at the peak some of those are
    not posted yet: the runtime holds up to those fewer, never more; tested).
    ``opts``: ``(checkpointing, dtype, prefetch)``; ``sp``: sequence parallelism;
    ``residual``: the residual stream's format (None: the compute dtype's)."""
    v = len(prank.chunk_blocks)
    sets = in_flight_sets(schedule, pipe, prank.rank, v, micro_batches)
    ahead = sum(boundaries_of_rank(pipe, prank.rank, v))
    layout = (prank.blocks, prank.first, prank.last, prank.chunk_blocks)
    args = (layout, sets, ahead, opts, sp, residual)
    return _in_flight(model, tuple(grid), micro_batch, seq_len, *args)


@functools.lru_cache(maxsize=1 << 14)
def _in_flight(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    layout: tuple,
    sets: tuple,
    ahead: int,
    opts: tuple,
    sp: bool = False,
    residual: str | None = None,
) -> tuple[float, float, float]:
    """:func:`in_flight_bytes` of a rank of ``layout`` (:func:`_chunks`), in-flight ``sets``
    and ``ahead`` receives posted ahead, once per those (ranks alike in them share it, with
    the optimizer sharded or not)."""
    saved, held, out = _chunks(model, grid, micro_batch, seq_len, layout, opts, sp, residual)
    # the context masks and chunk order: built once per stage and shared by its passes
    shared = 0.0
    if opts[0].partition(":")[0] != "full":
        shared = context_shared_bytes(seq_len, context_size(grid), dtype_bytes(opts[1]))
    saved = [s - shared for s in saved]
    best = sets[0]
    if len(sets) > 1:
        per = list(map(operator.add, saved, held))
        best = max(sets, key=lambda c: sum(map(operator.mul, c, per)) + shared * sum(map(bool, c)))
    in_flight = sum(map(operator.mul, best, saved)) + shared * sum(map(bool, best))
    # receive buffers live from their posting to their pass's backward: the inputs of the
    # passes in flight on stages other than stage 0 (torch's forward cache keeps them), and at
    # most one posted ahead per stage and direction the rank receives in
    inputs = sum(n for k, n in enumerate(best) if not (layout[1] and k == 0))
    persistent = (inputs + ahead) * out
    return in_flight, sum(map(operator.mul, best, held)), persistent


COMPONENTS = (
    "activations",
    "logits_and_loss",
    "recompute_activations",
    "gathered_weights",
    "reduce_scatter_buffers",
    "step_buffers",
)
"""The runtime model's components besides the model states (0 where not alive at the peak)."""


def stage_memory(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    prank: PipeRank,
    schedule: str,
    pipe: int,
    micro_batches: int,
    *,
    activation_checkpointing: str = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
    shard_optimizer: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool = False,
    residual: str | None = None,
) -> MemoryBreakdown:
    """The memory of pipeline rank ``prank`` of ``pipe`` under ``schedule`` with
    ``micro_batches`` per step (module doc), ``grid`` the 5D roles' sizes; with
    ``shard_optimizer`` the AdamW states over ``G_data G_context``
    (:mod:`tetrad.plan.memory.sharded_optimizer`); ``expert``, ``imbalance``: an MoE
    model's, as :func:`tetrad.plan.memory.runtime.runtime_memory`'s (a stage's MoE blocks
    counted as the model's first blocks would be); ``params``: the weights' stored format;
    ``sequence_parallel``: the residual stream split along the sequence over Y, the stage
    boundaries' tensors too (``"regather"``: and the first Linears' inputs kept split);
    ``residual``: the residual stream's format (None: ``dtype``).

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    grid = tuple(grid)
    opts = (activation_checkpointing, dtype, prefetch)
    if model.n_experts:  # its weights' format changes its saved activations: in opts too
        opts += (expert, imbalance) + ((params,) if params != "fp32" else ())
    # the runtime model's parts first: its errors come before the schedule's
    sp = sequence_parallel
    more = _activation_args(sp, residual)
    args = _parts_args(opts, shard_optimizer)
    stage_parts(
        model, prank.blocks, grid, micro_batch, seq_len, *args, **_params_arg(params, opts), **more
    )
    v = len(prank.chunk_blocks)
    sets = in_flight_sets(schedule, pipe, prank.rank, v, micro_batches)
    ahead = sum(boundaries_of_rank(pipe, prank.rank, v))
    layout = (prank.blocks, prank.first, prank.last, prank.chunk_blocks)
    args = (layout, sets, ahead, pipe > 1, opts, shard_optimizer, params, sp, residual)
    static, live, totals, peak = _stage_phases(model, grid, micro_batch, seq_len, *args)
    zero = dict.fromkeys(COMPONENTS + (("pipeline_buffers",) if pipe > 1 else ()), 0.0)
    return MemoryBreakdown(
        components={**static, **zero, **live},
        gpu_memory_bytes=float(gpu_memory_bytes),
        peak_phase=f"stage rank {prank.rank}: {peak}",
        phases=dict(totals),
    )


@functools.lru_cache(maxsize=1 << 14)
def _stage_phases(
    model: ModelSpec,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    layout: tuple,
    sets: tuple,
    ahead: int,
    buffers: bool,
    opts: tuple,
    shard_optimizer: bool,
    params: str = "fp32",
    sp: bool = False,
    residual: str | None = None,
) -> tuple[dict[str, float], dict[str, float], dict[str, float], str]:
    """``(static components, the peak phase's live components, every phase's total, the peak
    phase)`` of :func:`stage_memory` for a rank of ``layout`` (:func:`_chunks`), in-flight
    ``sets`` and ``ahead`` receives posted ahead, once per those (ranks alike in them share
    it; the caller copies the dicts)."""
    blocks, first, last, _ = layout
    more = _activation_args(sp, residual)
    args = _parts_args(opts, shard_optimizer)
    static, phases, saved = stage_parts(
        model, blocks, grid, micro_batch, seq_len, *args, **_params_arg(params, opts), **more
    )
    static = dict(static)
    share = state_share(grid, shard_optimizer and data_group(grid) > 1)
    emb_el, head_el, final_norm = table_elements(model, grid)
    head = 0 if model.tied_embeddings else head_el  # a tied head is the embedding's table
    drop = (0 if first else emb_el) + (0 if last else head + final_norm)
    add = head_el if last and not first and model.tied_embeddings else 0
    per_state = optimizer_bytes_per_element(params) * share
    per_param = param_bytes(params)
    for name, per in (("parameters", per_param), ("gradients", 4), ("optimizer_states", per_state)):
        static[name] += per * (add - drop)
    if shard_optimizer and data_group(grid) > 1 and not (first and last):
        phases = {
            **phases,
            "optimizer step": {
                "step_buffers": _stage_step(model, blocks, grid, opts, params, first, last)
            },
        }
    flight = _in_flight(model, grid, micro_batch, seq_len, layout, sets, ahead, opts, sp, residual)
    live = _live_phases(phases, saved, first, last, flight, buffers)
    base = sum(static.values())
    totals = {name: base + sum(c.values()) for name, c in live.items()}
    peak = max(totals, key=lambda k: totals[k])
    return static, live[peak], totals, peak


def _stage_step(
    model: ModelSpec, blocks: int, grid: tuple, opts: tuple, params: str, first: bool, last: bool
) -> float:
    """The sharded optimizer's step buffers on a pipeline rank that holds ``blocks`` blocks and
    the embedding (``first``) or the final norm and LM head (``last``) or neither: its own
    reduced pieces and its first unit's all-gather
    (:func:`tetrad.plan.memory.sharded_optimizer.step_bytes`), or an MoE stage's flat sum of
    its expert-sharded weights if larger (as the whole model's)."""
    sm = stage_model(model, blocks)
    expert = opts[3] if len(opts) > 3 else 1
    step = sharded_optimizer.step_bytes(sm, grid, True, expert, params, first, last)
    # (the pipeline's parts run the default overlaps: their expert sums during backward)
    return max(step, step_buffer_bytes(sm, grid, expert, True)) if expert > 1 else step


def _live_phases(
    phases: dict, saved: dict, first: bool, last: bool, flight: tuple, buffers: bool
) -> dict[str, dict[str, float]]:
    """Each phase's live components (module doc): the runtime model's ``phases`` of one
    micro-batch through the rank's blocks (``saved``: its saved activations), the other
    in-flight passes' saved tensors added to ``activations`` up to the end of backward, and with
    ``buffers`` the receive buffers and held outputs (``flight``: :func:`in_flight_bytes`) as
    ``pipeline_buffers``; ``first``, ``last``: the rank runs stage 0, the last stage."""
    in_flight, held, persistent = flight
    one = saved["blocks"] + (saved["embedding"] if first else 0.0)
    if last:
        one += saved["final_norm"] + saved["loss"]
    live: dict[str, dict[str, float]] = {}
    for name, comps in phases.items():
        if name in HEAD_PHASES and not last:
            continue
        comps = dict(comps)
        if "activations" in comps and not first:
            comps["activations"] -= saved["embedding"]
        if name not in ENDS:
            comps["activations"] = comps.get("activations", 0.0) + in_flight - one
        if buffers:
            comps["pipeline_buffers"] = persistent + (0.0 if name in ENDS else held)
        live[name] = comps
    return live


def pipeline_memory(
    model: ModelSpec,
    grid,
    micro_batch: int,
    seq_len: int,
    gpu_memory_bytes: float,
    ranks: tuple[PipeRank, ...],
    schedule: str,
    virtual: int,
    micro_batches: int,
    *,
    activation_checkpointing: str = "none",
    dtype: str = "bf16",
    prefetch: bool = True,
    shard_optimizer: bool = False,
    expert: int = 1,
    imbalance: float = 1.0,
    params: str = "fp32",
    sequence_parallel: bool = False,
    residual: str | None = None,
) -> tuple[MemoryBreakdown, list[MemoryBreakdown]]:
    """``(worst rank's breakdown, every rank's)`` of a pipeline of ``len(ranks)`` ranks under
    ``schedule`` with ``micro_batches`` per step (module doc); ``virtual``, the stages per
    rank, is each rank's ``len(chunk_blocks)``.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, an unknown dtype, or ranks
            without ``virtual`` stages each.
    """
    if any(len(r.chunk_blocks) != virtual for r in ranks):
        raise PlanError(f"pipeline ranks {ranks} do not have {virtual} stages each")
    out = [
        stage_memory(
            model,
            grid,
            micro_batch,
            seq_len,
            gpu_memory_bytes,
            r,
            schedule,
            len(ranks),
            micro_batches,
            activation_checkpointing=activation_checkpointing,
            dtype=dtype,
            prefetch=prefetch,
            shard_optimizer=shard_optimizer,
            expert=expert,
            imbalance=imbalance,
            params=params,
            sequence_parallel=sequence_parallel,
            residual=residual,
        )
        for r in ranks
    ]
    return max(out, key=lambda mb: mb.total), out
