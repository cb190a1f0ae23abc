"""Step-time model of the 4D (with context, 5D) grid: the predicted seconds of one optimizer step
on one rank (:func:`estimate`), compute plus the optimizer plus the exposed part of every
collective: its bytes, its time on the network, and how much of it the runtime's overlap
schedule hides. A pipeline grid's step builds on it: :mod:`tetrad.plan.pipe.pipeline_step`.

Step time (seconds), ``acc`` micro-batches per step::

    step = acc (forward + backward + recompute) + optimizer + sum over collectives of exposed

compute per micro-batch from :mod:`tetrad.plan.compute.block`, the optimizer's element-wise
AdamW over the local parameters (:data:`tetrad.plan.compute.elementwise.ELEMENTWISE`).

Communication, two modes.

``tetrad`` (:func:`estimate`, :func:`collectives`) predicts exactly the collectives tetrad's
runtime issues (tetrad/parallel/{linear,head,embedding,norm,loss,grads,overlap}.py,
tetrad/train/step.py). Per micro-batch, ``m = micro_batch * seq_len`` tokens per rank, compute
dtype ``c`` bytes (2 for bf16 on GPU, 4 on CPU), gradients fp32. For a Linear ``[n, k]`` with input
axis ``I`` and output axis ``O`` (X and Y; swapped when transposed):

    forward   all-gather_Z   W shard cast to c          output  n k / (G_x G_y) * c
              all-reduce_I   y                          m n / G_O * c
    backward  all-gather_Z   W again                    n k / (G_x G_y) * c
              all-reduce_O   dx                         m k / G_I * c
              reduce-scatter_Z dW (fp32)                input   n k / (G_x G_y) * 4
    LM head   vocabulary over Y and X: W's Z all-gather (forward only: W is kept for
              backward) and reduce-scatter as a Linear (V h / (G_x G_y)); forward all-gather_X
              of its input m h * c; backward
              reduce-scatter_X m h * c, then all-reduce_Y m h / G_x * c (no logits move)
    embedding all-gather_Z   V h / (G_y G_x) * c (as a Linear's weight); all-reduce_Y m h / G_x * 4;
              backward reduce-scatter_Z V h / (G_y G_x) * 4
    RMSNorm   all-reduce_X   m * 4 forward and backward (2 per block + the final one)
    loss      3 all-reduce_Y and 3 all-reduce_X of m * 4 (max, sum of exp, target logit),
              forward only
    context   all-gather_context of K and V, payload (output) b S 2 kv_dim / G_y * c per block
              and micro-batch, forward (and recompute); backward reduce-scatter_context of
              their gradients, the same payload (input); with the ``context`` overlap in n
              pieces of 1/n each, hidden behind the pieces' attention, else blocking
              (:mod:`tetrad.plan.comm.context_parallel`; with G_context > 1, ``m = b S / G_context``
              and the data group is data x context, G_data G_context ranks)
    recompute (``full`` activation checkpointing) a block's forward collectives once more in
              backward; ``selective`` re-runs element-wise work only, no collective
    step      all-reduce_data of the Z-sharded weight gradients (sum of local shards, fp32);
              norm-weight gradients all-reduce_Z then all-reduce_data; the loss scalar (4 B)
              over Z and data; the gradient-norm scalar (8 B, float64) over the world (none
              with data parallelism alone). With the sharded optimizer
              (:mod:`tetrad.plan.question`) the data all-reduces are reduce-scatters of the
              same payload, followed after the update by one all-gather per unit
              (embedding, block, head; behind the next forward: layers.parameter_gathers);
              norm: world.

A size-1 axis issues nothing. Times come from the alpha-beta ring model of
:mod:`tetrad.plan.machine.network` with each axis's placement.

Overlap (the runtime's :mod:`tetrad.parallel.overlap`, names :data:`tetrad.spec.overlap.OVERLAPS`;
``none`` exposes everything). Collectives on one axis share one communicator, hence one stream,
and run in issue order; collectives on different axes run concurrently (link contention between
axes is not modelled). Steady state, every block alike:

- ``prefetch``: the Z all-gathers of the next two weights in execution order (forward,
  recompute and backward; :data:`tetrad.spec.overlap.PREFETCH_DEPTH`) run during the current layer's
  window (its GEMMs and the element-wise work up to the next Linear); with several
  micro-batches per step the order runs on into the next one (its embedding table and first
  block weight behind this one's last backward windows). The Z stream is replayed in issue
  order (:mod:`tetrad.plan.comm.zqueue`): the compute stalls when a weight's all-gather has not
  ended. Without prefetch the all-gather is blocking and waits behind whatever is queued.
- ``reduce_scatter``: the dW reduce-scatter is asynchronous, issued after the next prefetch
  (while the micro-batch has all-gathers left); those still running when an all-gather is
  waited for, or when the micro-batch ends, are exposed.
- ``dx_all_reduce``: the backward dx all-reduce runs during the dW GEMM: exposed ``max(0, t -
  dW)`` (the LM head's Y all-reduce during the scaling of its ``dW``, which the fused loss
  formed in forward).
- ``domino``: the forward all-reduce of a Linear's output is split in two halves (when ``m >= 2 *
  domino_min_rows``); the first half's all-reduce runs during the second half's GEMM: exposed
  ``t_2 + max(0, t_1 - GEMM/2)``.
- ``fine``: each block Linear's forward all-reduce and backward dx all-reduce is a reduce-scatter
  fused with its GEMM (exposed: the fused ring's time, replayed event by event by
  :mod:`tetrad.plan.comm.fine`, minus the GEMM) and an all-gather (exposed; in backward during
  the dW GEMM with ``dx_all_reduce``). Where the rows do not split over the group, as without
  it. With ``overlaps="all"`` it is used only where it lowers the exposed time, with the best
  chunk count of :data:`tetrad.plan.comm.fine.CHUNK_CANDIDATES` (:attr:`Estimate.fine_chunks`,
  what the runtime then runs); named explicitly it is always on.
- ``dp_all_reduce``: in the last micro-batch the weight gradients are all-reduced over data in
  buckets (``bucket_bytes``) as the reduce-scatters complete; a block's buckets run during the
  backward (and recompute) of the block below; the queue carries over; what is left when the
  backward ends is exposed.
- ``context``: the context K/V all-gather and its gradient reduce-scatter in ``n`` pieces,
  each hidden behind the attention (forward, recompute; backward) of the piece before it:
  exposed ``t_1 + (n - 1) max(0, t_1 - attention / n)`` per block and micro-batch
  (:func:`tetrad.plan.comm.context_parallel.pieces_exposed_seconds`).
- always exposed: norm, embedding and loss all-reduces, the LM head's X all-gather and
  reduce-scatter, the step-level collectives.

``axonn`` (:func:`tetrad.plan.comm.axonn.axonn_comm`) reproduces AxoNN's published model
(Megatron-AxoNN ``examples/comm_model.py``, ``model_v2``; Singh et al., arXiv 2305.13525): per
block Linear, volume terms in bf16 elements, GiB over the measured bandwidth, summed, no latency,
no overlap, no embedding, head, norms or loss. Where it deviates from the true layout, see
:func:`tetrad.plan.comm.axonn.axonn_comm`.

Code: :func:`estimate` builds a :class:`~tetrad.plan.comm.record.Step` (grid, links, ``m``,
micro-batches, compute times, overlap switches) and calls the functions of :data:`LAYER_KINDS`,
one per layer kind, each recording into a :class:`~tetrad.plan.comm.record.Recorder`: the block
Linears' X/Y collectives in :mod:`tetrad.plan.comm.linears` (``forward_all_reduce``, the one
place that picks the forward all-reduce's overlap model: plain, Domino or ``fine``, and
``backward_all_reduce``), the Z ones in :mod:`tetrad.plan.comm.zwindows`, the others in
:mod:`tetrad.plan.comm.layers`. The order of :data:`LAYER_KINDS` is the order of the per-axis
sums.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tetrad.plan.comm import layers, linears, orientation
from tetrad.plan.comm.context_parallel import kv_gather_payload, local_seq_len
from tetrad.plan.comm.fp8_scales import amax_all_reduces
from tetrad.plan.comm.listing import Collective, listed
from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.comm.zwindows import z_collectives
from tetrad.plan.compute.elementwise import optimizer_seconds
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.question import StepQuestion, sharded, shards_optimizer
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.grid import ORIENTATIONS, physical_axis, role_sizes, with_context
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import DOMINO_MIN_ROWS, DP_BUCKET_BYTES
from tetrad.spec.sharding import grid_problems

__all__ = ["Estimate", "best_orientation", "collectives", "estimate", "make_step"]


@dataclass(frozen=True)
class Estimate:
    """Predicted time of one optimizer step on one rank (seconds).

    Attributes:
        step_s: step time.
        compute_s: compute (GEMMs, attention, element-wise, optimizer), all micro-batches.
        recompute_s: of which activation recomputation.
        exposed_s: exposed communication per axis.
        comm_s: all communication per axis (exposed + hidden).
        grad_accum: micro-batches per step.
        collectives: per-collective detail (only from
            :func:`tetrad.plan.step_time.collectives`).
        fine_chunks: pieces per ring step of the ``fine`` overlap as modelled (0: not used).
        context_pieces: the ``context_pieces`` option of the ``context`` overlap as modelled
            (1: the blocking K/V all-gather).
        orientation: the roles' orientation (:data:`tetrad.spec.grid.ORIENTATIONS`); the per-axis
            dicts and the collectives name the ``--grid``'s dimensions.
        shard_optimizer: modelled with the sharded optimizer (:mod:`tetrad.plan.question`).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    grad_accum: int
    collectives: tuple = ()
    fine_chunks: int = 0
    orientation: str = "xy"
    context_pieces: int = 1
    shard_optimizer: bool = False


LAYER_KINDS = (
    linears.block_linears,
    layers.context_kv,
    layers.lm_head,
    layers.loss,
    layers.embedding,
    layers.norms,
    z_collectives,
    amax_all_reduces,
    layers.data_gradients,
    layers.step_scalars,
)
"""The layer kinds :func:`estimate` records, in order (the order of the per-axis sums)."""

XY_KINDS = (linears.block_linears, layers.lm_head, layers.loss, layers.embedding, layers.norms)
"""The kinds that record on the X and Y axes only. They depend on the grid only through
``(G_context, G_y, G_x)``, the micro-batch, the micro-batches per step and whether blocks are
recomputed with their collectives, so their record is memoised (:func:`xy_record`); the other
kinds record on no X or Y axis, so running them after it sums every axis in the order of
:data:`LAYER_KINDS`, to the last bit."""
OTHER_KINDS = tuple(kind for kind in LAYER_KINDS if kind not in XY_KINDS)
"""The kinds of :data:`LAYER_KINDS` that are not in :data:`XY_KINDS`, in order."""


def make_step(
    ctx: StepQuestion,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    checkpointing: str | bool,
    orientation: str = "xy",
    wrap: bool = False,
) -> Step:
    """The :class:`Step` of the ``--grid`` ``grid = (G_data, [G_context,] G_z, G_y, G_x)`` under
    ``orientation`` (its ``sizes`` are the roles', its links the mesh dimensions' that play
    them; ``checkpointing``: a mode of
    :data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`; only ``full`` re-runs collectives):
    ``m`` counts this rank's ``S / G_context`` tokens per sample; the data group is data x
    context. ``wrap``: the micro-batches run back to back in one phase, as the 4D step's do
    (:meth:`tetrad.parallel.overlap.Overlap.begin_micro_batch`, ``phase="step"``), so the
    ``prefetch`` order runs on into the next one (:attr:`Step.wrap`); a pipeline stage runs
    its forward and backward phases apart: no wrap.

    Raises:
        PlanError: the global batch does not split into micro-batches on this grid.
    """
    physical = with_context(grid)
    gd, gc, gz, gy, gx = roles = role_sizes(physical, orientation)
    links = ctx.machine.network.grid_links(physical)
    if orientation == "yx":
        links = links | {"x": links["y"], "y": links["x"]}
    cells = gd * gz * micro_batch
    if ctx.global_batch % cells:
        raise PlanError(
            f"global batch {ctx.global_batch} is not divisible by G_data*G_z*"
            f"micro_batch = {gd}*{gz}*{micro_batch}: change the batch or the grid"
        )
    ov, m = ctx.overlaps, micro_batch * local_seq_len(ctx.seq_len, gc)
    _, block_el, head_el, emb_el = ctx.weight_shards(gx, gy, gz)
    acc = ctx.global_batch // cells
    comp = ctx.compute(roles, micro_batch).over_step(acc, gz)
    dp = "dp_all_reduce" in ov
    full = parse_checkpointing(checkpointing) == "full"
    most, pieces = (1, 1)
    if gc > 1:
        most, pieces = ctx.kv_choice(micro_batch, gy, links["context"], comp, full)
    return Step(
        model=ctx.model,
        linears=ctx.linears,
        sizes={"x": gx, "y": gy, "z": gz, "context": gc, "data": gd * gc},
        links=links,
        m=m,
        acc=acc,
        c=ctx.c,
        checkpointing=full,
        comp=comp,
        block_el=block_el,
        head_el=head_el,
        emb_el=emb_el,
        vector_el=ctx.vector_elements(gx, gy),
        bucket_calls=ctx.bucket_calls(gx, gy, gz) if dp and gd * gc > 1 else 0,
        prefetch="prefetch" in ov,
        async_scatter="reduce_scatter" in ov,
        dx_overlap="dx_all_reduce" in ov,
        domino="domino" in ov and m >= 2 * ctx.domino_min_rows,
        dp_overlap=dp,
        fine=ctx.fine,
        fused_s=ctx.fused_s,
        kv_payload=kv_gather_payload(ctx.model, micro_batch, ctx.seq_len, gy, ctx.c)
        if gc > 1
        else 0.0,
        context_pieces=most,
        kv_pieces=pieces,
        orientation=orientation,
        zero=shards_optimizer(ctx),
        wrap=wrap and "prefetch" in ov,
        fp8=ctx.fp8,
        z_weight_bytes=ctx.z_weight_bytes,
        param_bytes=ctx.param_bytes,
        residual_bytes=ctx.residual_bytes,
        sequence_parallel=sequence_parallel_applies(ctx, roles),
        sequence_regather=sequence_parallel_applies(ctx, roles)
        and ctx.sequence_parallel == "regather",
    )


def sequence_parallel_applies(ctx: StepQuestion, roles: tuple) -> bool:
    """Whether ``ctx`` asks for sequence parallelism and the runtime has it on these role
    sizes ``(G_data, G_context, G_z, G_y, G_x)`` (:meth:`StepQuestion.sequence_split`)."""
    return ctx.sequence_split(roles[1], roles[3], roles[4]) > 1


def best_orientation(
    ctx: StepQuestion,
    grid: tuple[int, ...],
    micro_batch: int,
    checkpointing: str | bool,
    by: str = "bytes",
) -> str:
    """The orientation of ``grid`` (the ``--grid``) among those whose roles shard the model
    (heads split over the Y role, :func:`tetrad.spec.sharding.grid_problems`): ``by="bytes"``
    the one whose X and Y collectives send fewer bytes
    (:func:`tetrad.plan.comm.orientation.choose`, independent of the machine), ``by="time"``
    the one with the shorter step on ``ctx``'s machine. ``xy`` when ``G_x = G_y = 1``, on a
    tie, or when neither shards the model.

    Raises:
        PlanError: the global batch does not split into micro-batches on this grid.
    """
    physical = with_context(grid)
    if physical[3] == physical[4] == 1:
        return "xy"
    fits = [o for o in ORIENTATIONS if not grid_problems(ctx.model, role_sizes(physical, o))]
    if len(fits) < 2:
        return fits[0] if fits else "xy"
    if by == "time":
        steps = [
            estimate(ctx, grid, micro_batch, checkpointing, orientation=o).step_s for o in fits
        ]
        return "yx" if steps[1] < steps[0] else "xy"
    xy = make_step(ctx, grid, micro_batch, checkpointing, "xy")
    yx = make_step(ctx, grid, micro_batch, checkpointing, "yx")
    return orientation.choose(xy, yx)


def estimate(
    ctx: StepQuestion,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    checkpointing: str | bool,
    *,
    orientation: str = "xy",
    detail: bool = False,
) -> Estimate:
    """Predicted step time (seconds) of the ``--grid`` ``grid = (G_data, [G_context,] G_z, G_y,
    G_x)`` under ``orientation`` (``auto``: :func:`best_orientation`; see the module doc):
    compute of ``acc`` micro-batches
    (:meth:`~tetrad.plan.compute.block.BlockCompute.micro_batch_seconds`), the optimizer over the
    local parameters, and the exposed seconds of every collective.

    Args:
        micro_batch: samples per micro-batch of one (data, z) cell.
        checkpointing: ``none``, ``selective`` or ``full`` (a bool: ``full``/``none``).
        detail: also return the per-collective list (slower; for reports and benchmarks).

    Raises:
        PlanError: the global batch does not split into micro-batches on this grid.
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown checkpointing mode.
    """
    if orientation == "auto":
        orientation = best_orientation(ctx, grid, micro_batch, checkpointing)
    st = make_step(ctx, grid, micro_batch, checkpointing, orientation, wrap=True)
    if detail:  # every row, in the order of LAYER_KINDS
        rec = Recorder(True)
        for kind in LAYER_KINDS:
            kind(rec, st)
    else:
        rec = xy_record(ctx, st).copy()
        for kind in OTHER_KINDS:
            kind(rec, st)
    local = st.n_layers * st.block_el + st.head_el + st.emb_el + st.vector_el
    optimizer = optimizer_seconds(
        local, ctx.machine.hbm_bytes_per_s, st.optimizer_shards, ctx.param_bytes
    )
    fwd_mb, bwd_mb, rec_mb = st.comp.micro_batch_seconds(st.n_layers, checkpointing)
    compute = st.acc * (fwd_mb + bwd_mb + rec_mb) + optimizer
    step = compute + sum(rec.exposed.values())
    cols = listed(rec, st.sizes, st.world, orientation)
    exposed, total = (
        {physical_axis(a, orientation): v for a, v in d.items()} for d in (rec.exposed, rec.total)
    )
    return Estimate(
        step,
        compute,
        st.acc * rec_mb,
        exposed,
        total,
        st.acc,
        cols,
        st.fine_chosen,
        orientation,
        st.context_pieces,
        st.zero,
    )


def xy_record(ctx: StepQuestion, st: Step) -> Recorder:
    """The record (no detail) of the :data:`XY_KINDS` of ``st``, memoised in ``ctx`` per
    ``(G_context, G_y, G_x, m, micro-batches, full recompute)``: a block Linear's X/Y
    collectives recur across the ``(G_data, G_z)`` splits of a grid's product. Sets
    ``st.fine_chosen``; the returned record is shared: copy it before adding to it."""
    s = st.sizes
    key = (s["context"], s["y"], s["x"], st.m, st.acc, st.checkpointing, st.orientation)
    got = ctx.xy_records.get(key)
    if got is None:
        rec = Recorder(False)
        for kind in XY_KINDS:
            kind(rec, st)
        got = ctx.xy_records[key] = (rec, st.fine_chosen)
    st.fine_chosen = got[1]
    return got[0]


def collectives(
    model: ModelSpec,
    machine: Machine,
    grid: tuple[int, int, int, int],
    micro_batch: int,
    seq_len: int,
    global_batch: int,
    *,
    activation_checkpointing: str | bool = "none",
    overlaps: str | Iterable[str] = "all",
    compute_bytes: int = 2,
    bucket_bytes: int = DP_BUCKET_BYTES,
    domino_min_rows: int = DOMINO_MIN_ROWS,
    fine_chunks: int | None = None,
    orientation: str = "xy",
    context_pieces: int | None = None,
    shard_optimizer: bool = False,
    fp8: str = "off",
    param_bytes: int = 4,
    sequence_parallel: bool | str = False,
    residual_bytes: int | None = None,
) -> list[Collective]:
    """Every collective of one optimizer step of tetrad's runtime on one rank: layer, phase,
    axis, kind, payload bytes per call, calls, ring bytes and seconds per call, the compute it
    hides behind and its exposed seconds per step (module doc). ``grid = (G_data, G_z, G_y,
    G_x)``; ``micro_batch`` samples per (data, z) cell. ``compute_bytes``: 2 on GPU (bf16
    autocast), 4 on CPU; ``bucket_bytes``, ``domino_min_rows`` and ``context_pieces``: the
    runtime's ``Overlap`` options (``context_pieces`` None: the planner's best);
    ``orientation``: as :func:`estimate`'s; ``shard_optimizer``: the runtime's sharded
    optimizer (:mod:`tetrad.plan.question`); ``fp8``: the FP8 recipe
    (:mod:`tetrad.plan.compute.fp8`); ``param_bytes``: the weights' stored bytes per element
    (2 with ``--param-dtype bf16``); ``sequence_parallel``: the runtime's
    ``--sequence-parallel`` (``"regather"``: with ``--sequence-parallel-regather``);
    ``residual_bytes``: the residual stream's bytes per element
    (``--residual-dtype``; None: ``compute_bytes``) (:class:`~tetrad.plan.question.StepQuestion`).

    Raises:
        PlanError: the batch does not split on the grid, or a bad overlap name.
    """
    ctx = StepQuestion(
        model,
        machine,
        seq_len,
        global_batch,
        overlaps=overlaps,
        compute_bytes=compute_bytes,
        param_bytes=param_bytes,
        residual_bytes=residual_bytes,
        bucket_bytes=bucket_bytes,
        domino_min_rows=domino_min_rows,
        fine_chunks=fine_chunks,
        context_pieces=context_pieces,
        fp8=fp8,
        sequence_parallel=sequence_parallel,
    )
    est = estimate(
        sharded(ctx) if shard_optimizer else ctx,
        tuple(grid),
        micro_batch,
        activation_checkpointing,
        orientation=orientation,
        detail=True,
    )
    return list(est.collectives)
