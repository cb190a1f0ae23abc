"""The collectives of one optimizer step other than the block Linears' X/Y all-reduces
(:mod:`tetrad.plan.comm.linears`) and the Z ones (:mod:`tetrad.plan.comm.zwindows`): context
K/V, the LM head, the loss, the embedding, the norms, the data-parallel gradients and the
step-level scalars, one function per layer kind (the model is stated in the module doc of
:mod:`tetrad.plan.step_time`).

Each function takes a :class:`~tetrad.plan.comm.record.Recorder` and a
:class:`~tetrad.plan.comm.record.Step` and records the collectives of one kind of layer: bytes
per call, calls per step, seconds per call (alpha-beta,
:meth:`tetrad.plan.machine.network.Link.time`) and exposed seconds per step.
"""

from __future__ import annotations

from tetrad.plan.comm.context_parallel import pieces_exposed_seconds
from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.machine.network import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tetrad.spec.grid import Axis
from tetrad.spec.units import FP32


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


def context_kv(rec: Recorder, st: Step) -> None:
    """Context parallelism (tetrad/parallel/context.py): per block and micro-batch an all-gather
    of K and V over context (``kv_payload``, the output), again in recompute under full
    checkpointing, and a reduce-scatter of their gradients in backward (the same payload, the
    input); each in ``kv_pieces`` calls of ``1/n`` of the payload, each piece hidden behind the
    attention of the piece before it
    (:func:`tetrad.plan.comm.context_parallel.pieces_exposed_seconds`; one piece: blocking)."""
    if st.sizes["context"] == 1:
        return
    k, link, n = st.kv_pieces, st.links["context"], st.n_layers * st.acc
    p, hid = st.kv_payload / k, "attention" if k > 1 else ""
    t = link.time(ALL_GATHER, p)
    e = n * pieces_exposed_seconds(t, st.comp.attention / k, k)
    rec.add("attention_kv", "forward", "context", ALL_GATHER, p, n * k, t, e, hid)
    if st.checkpointing:
        rec.add("attention_kv", "recompute", "context", ALL_GATHER, p, n * k, t, e, hid)
    t = link.time(REDUCE_SCATTER, p)
    e = n * pieces_exposed_seconds(t, st.comp.attention_bwd / k, k)
    rec.add("attention_kv", "backward", "context", REDUCE_SCATTER, p, n * k, t, e, hid)


def lm_head(rec: Recorder, st: Step) -> None:
    """The LM head (tetrad/parallel/head.py: vocabulary over Y and X, input gathered over X),
    ``acc`` calls each, never recomputed; no collective grows with ``V``. Forward: all-gather
    over X of its input, payload ``m h c`` (the output). Backward: reduce-scatter over X of the
    input gradient, payload ``m h c`` (the input), then all-reduce over Y of ``m h / G_x * c``
    (with ``dx_all_reduce`` during the scaling of the head's ``dW``, which the fused loss formed
    in forward: exposed ``max(0, t - scaling)``). Under sequence parallelism the input is first
    all-gathered along the sequence over Y, payload ``m h / G_x c``, and in backward that
    all-reduce over Y is a reduce-scatter of the same payload (hidden as the all-reduce was)."""
    m, h, c, acc = st.m, st.model.dim, st.c, st.acc
    gx, gy = st.sizes["x"], st.sizes["y"]
    if st.sequence_parallel:
        p = m * h / gx * c
        t = st.links["y"].time(ALL_GATHER, p)
        rec.add("output", "forward", "y", ALL_GATHER, p, acc, t, acc * t)
    if gx > 1:
        p = m * h * c
        t = st.links["x"].time(ALL_GATHER, p)
        rec.add("output", "forward", "x", ALL_GATHER, p, acc, t, acc * t)
        t = st.links["x"].time(REDUCE_SCATTER, p)
        rec.add("output", "backward", "x", REDUCE_SCATTER, p, acc, t, acc * t)
    if gy > 1:
        p = m * h / gx * c
        kind = REDUCE_SCATTER if st.sequence_parallel else ALL_REDUCE
        t = st.links["y"].time(kind, p)
        e = _max0(t - st.comp.head_dw_scale) if st.dx_overlap else t
        hid = "dW scaling" if st.dx_overlap else ""
        rec.add("output", "backward", "y", kind, p, acc, t, acc * e, hid)


# ---- always-exposed all-reduces: loss, embedding, norms ---------------------------------------


def loss(rec: Recorder, st: Step) -> None:
    """Vocabulary-parallel cross-entropy over Y and X: 3 all-reduces of ``m * 4`` bytes (max,
    sum of exp, target logit) over each of Y and X per micro-batch, forward only."""
    for ax in (Axis.Y, Axis.X):
        if st.sizes[ax] > 1:
            p = st.m * FP32
            t = st.links[ax].time(ALL_REDUCE, p)
            rec.add("loss", "forward", ax, ALL_REDUCE, p, 3 * st.acc, t, 3 * st.acc * t)


def embedding(rec: Recorder, st: Step) -> None:
    """Embedding lookups (token table, GPT: position table): all-reduce ``m h / G_x * r`` bytes
    over Y per table and micro-batch, in the residual stream's format (the runtime casts the
    rows to it before the sum): ``r`` = :attr:`Step.residual_bytes`, the compute dtype's ``c``
    under ``--residual-dtype auto``; under sequence parallelism a reduce-scatter along the
    sequence over Y of the same payload in forward and an all-gather of its gradient (the
    same payload: the stream's gradient has its format) in backward."""
    r = st.residual_bytes or st.c
    if st.sequence_parallel:
        p = st.m * st.model.dim / st.sizes["x"] * r
        link = st.links["y"]
        t = link.time(REDUCE_SCATTER, p)
        rec.add("embedding", "forward", "y", REDUCE_SCATTER, p, st.acc, t, st.acc * t)
        t = link.time(ALL_GATHER, p)
        rec.add("embedding", "backward", "y", ALL_GATHER, p, st.acc, t, st.acc * t)
        return
    if st.sizes["y"] > 1:
        p = st.m * st.model.dim / st.sizes["x"] * r
        t = st.links["y"].time(ALL_REDUCE, p)
        rec.add("embedding", "forward", "y", ALL_REDUCE, p, st.acc, t, st.acc * t)
        if st.model.max_positions:
            rec.add("positions", "forward", "y", ALL_REDUCE, p, st.acc, t, st.acc * t)


def norms(rec: Recorder, st: Step) -> None:
    """Norm statistics: all-reduce ``m * 4`` bytes (GPT LayerNorm: ``m * 8``) over X, ``2 L + 1``
    per micro-batch forward and backward, ``2 L`` in recompute (``m / G_y`` rows under sequence
    parallelism)."""
    if st.sizes["x"] > 1:
        rows = st.m // st.sizes["y"] if st.sequence_parallel else st.m
        p = rows * FP32 * (2 if st.model.family == "gpt" else 1)
        t = st.links["x"].time(ALL_REDUCE, p)
        L, acc = st.n_layers, st.acc
        nf = (2 * L + 1) * acc
        rec.add("norm", "forward", "x", ALL_REDUCE, p, nf, t, nf * t)
        if st.checkpointing:
            rec.add("norm", "recompute", "x", ALL_REDUCE, p, 2 * L * acc, t, 2 * L * acc * t)
        rec.add("norm", "backward", "x", ALL_REDUCE, p, nf, t, nf * t)


# ---- data-parallel gradients and step-level collectives ----------------------------------------


def data_gradients(rec: Recorder, st: Step) -> None:
    """All-reduce over data of the local weight-gradient shards ``(L block + head + embedding)
    * 4`` bytes: once at the step (blocking), or with ``dp_all_reduce`` in ``bucket_calls``
    buckets during the last micro-batch's backward, a block's buckets behind the backward (and
    recompute) of the block below, the queue carried over; what is left is exposed (seconds).
    With ``G_z = 1`` the vectors (``vector_el * 4`` bytes) join the last bucket, exposed with
    the embedding's gradient (:attr:`Step.vectors_in_buckets`).

    With the sharded optimizer (:attr:`Step.zero`, tetrad/parallel/zero.py) each all-reduce is
    a reduce-scatter of the same payload (bucketed and hidden the same way), and after the
    update each group is all-gathered over data (same payload, one call per reduce-scatter),
    waited before the next step's first forward use of its parameters
    (:func:`parameter_gathers`), in the weights' stored format (:attr:`Step.param_bytes`)."""
    if st.sizes["data"] == 1:
        return
    ld, L = st.links["data"], st.n_layers
    kind = REDUCE_SCATTER if st.zero else ALL_REDUCE
    w_total = gradient_bytes(st)
    weights = w_total * st.param_bytes / FP32  # the same elements as stored
    if not st.dp_overlap:
        t = ld.time(kind, w_total)
        rec.add("gradients", "step", "data", kind, w_total, 1, t, t)
        parameter_gathers(rec, st, "parameters", weights, 1)
        return
    calls = st.bucket_calls
    slack = st.comp.block_bwd + (st.comp.block_fwd if st.checkpointing else 0.0)
    exp = bucket_exposed(*bucket_seconds(st), slack, L)
    t = ld.time(kind, w_total / calls)
    hid = "backward of the blocks below (last micro-batch, buckets)"
    rec.add("gradients", "backward", "data", kind, w_total / calls, calls, t, exp, hid)
    if st.zero:
        big = bucket_seconds(st, ALL_GATHER, st.param_bytes)
        fwd = gather_exposed(*big, st.comp.block_fwd, L, _lead(st), st.chunks, st.rounds)
        parameter_gathers(rec, st, "parameters", weights / calls, calls, fwd)


def parameter_gathers(
    rec: Recorder, st: Step, layer: str, payload: float, calls: int, exposed: float | None = None
) -> None:
    """With the sharded optimizer: ``calls`` all-gathers over data of ``payload`` bytes each
    (the updated parameters, fp32), issued after the update in the order the next forward uses
    the parameters and each waited before that first use (tetrad/parallel/zero.py; fp32, or bf16
    weights: ``payload`` is in their format); ``exposed``
    seconds per step (:func:`gather_exposed`; None: one group, waited before the embedding's
    lookup, all exposed)."""
    if st.zero and st.sizes["data"] > 1:
        t = st.links["data"].time(ALL_GATHER, payload)
        hid = "" if exposed is None else "next step's forward (first micro-batch)"
        e = calls * t if exposed is None else exposed
        rec.add(layer, "step", "data", ALL_GATHER, payload, calls, t, e, hid)


def _lead(st: Step) -> int:
    """Blocks by which a weight's first read comes before its block's forward: 1 when the Z
    all-gathers prefetch (:data:`tetrad.spec.overlap.PREFETCH_DEPTH` weights ahead, less than a
    block:
    counted as a whole block, so the exposure is not underestimated), else 0."""
    return 1 if st.prefetch and st.sizes["z"] > 1 else 0


def gather_exposed(
    big_d: float,
    big_h: float,
    big_e: float,
    fwd: float,
    n_layers: int,
    lead: int = 0,
    chunks: int = 1,
    rounds: int = 1,
) -> float:
    """Exposed seconds of the sharded optimizer's bucketed parameter all-gathers over data
    (:func:`data_gradients`), from the seconds of a block's, the LM head's and the embedding's
    (with the vectors) share of the buckets (:func:`bucket_seconds` of the all-gather) and a
    block's forward ``fwd`` (seconds, one micro-batch).

    The all-gathers are issued back to back after the update in the order of the next forward,
    embedding, block 1 to ``L``, head; a unit waits for its own (done at ``C``: the seconds of
    those before it and its own) before its first read, after ``H`` seconds of the next step's
    forward (the embedding: none, its lookup is the step's first read; block ``k``:
    ``max(0, k - 1 - lead)`` block forwards, ``lead`` the blocks by which a Z prefetch reads a
    weight early). The forward is delayed by the largest ``C - H`` (a queue: a late wait
    delays every later one by as much); ``C - H`` is linear in ``k``, so blocks 1, ``1 + lead``
    and the last are enough. The embedding's and the first block's all-gathers are always
    exposed.

    A pipeline rank with ``chunks`` stages (interleaved 1F1B) runs ``rounds`` micro-batches
    through a stage before the next stage's first forward: stage ``c``'s blocks are read
    ``c rounds`` stage forwards later. Stages counted at the largest's blocks in ``C`` and the
    smallest's in ``H``, and a pipeline's fill not counted, so the exposure is never below the
    runtime's. Megatron-LM's ``overlap_param_gather`` hides them the same way (Shoeybi et al.,
    arXiv 1909.08053; Narayanan et al., arXiv 2104.04473, interleaved schedule)."""
    big, small = -(-n_layers // chunks), n_layers // chunks
    late = big_e
    for c in range(chunks):
        c0, h0 = big_e + c * big * big_d, c * rounds * small * fwd
        for k in {1, min(big, 1 + lead), big}:
            late = max(late, c0 + k * big_d - h0 - max(0, k - 1 - lead) * fwd)
    h_head = (chunks - 1) * rounds * small * fwd + max(0, small - lead) * fwd
    return max(late, big_e + chunks * big * big_d + big_h - h_head)


def gradient_bytes(st: Step) -> float:
    """Bytes of the data-parallel all-reduce: the local weight-gradient shards, fp32, and the
    vectors when they ride in the last bucket."""
    vec = st.vector_el if st.vectors_in_buckets else 0.0
    return (st.n_layers * st.block_el + st.head_el + st.emb_el + vec) * FP32


def bucket_seconds(
    st: Step, kind: str | None = None, elem_bytes: int = FP32
) -> tuple[float, float, float]:
    """All-reduce (reduce-scatter with :attr:`Step.zero`; ``kind`` when given) seconds of one
    block's, the LM head's and the embedding's (with the vectors riding along) share of the
    ``dp_all_reduce`` buckets: their bytes at the bucketed collective's seconds per byte, the
    per-call latency spread over the bytes; ``elem_bytes`` per element (4: the gradients; the
    weights' stored bytes for the all-gathers after the sharded update)."""
    ld, calls = st.links["data"], st.bucket_calls
    w_total = gradient_bytes(st) * elem_bytes / FP32
    kind = kind or (REDUCE_SCATTER if st.zero else ALL_REDUCE)
    vec = st.vector_el if st.vectors_in_buckets else 0.0
    lat = ld.time(kind, 0.0)
    per_byte = (ld.time(kind, w_total) - lat) / w_total
    rate = calls / w_total * lat + per_byte  # seconds per byte, latency spread over the bytes
    big_d = st.block_el * elem_bytes * rate
    return big_d, st.head_el * elem_bytes * rate, (st.emb_el + vec) * elem_bytes * rate


def bucket_exposed(big_d: float, big_h: float, big_e: float, slack: float, n_layers: int) -> float:
    """Exposed seconds of the bucketed data-parallel all-reduce (:func:`data_gradients`) from
    the buckets' seconds of a block, the LM head and the embedding (:func:`bucket_seconds`) and
    the compute of a block's backward (and recompute) they hide behind, ``slack``: the head's
    buckets behind the top block, each block's behind the block below, the queue carried over;
    the bottom block's and the embedding's are exposed."""
    x = _max0(big_h - slack)
    if n_layers > 1:
        x = (
            x + (n_layers - 1) * (big_d - slack)
            if big_d >= slack
            else _max0(x - (n_layers - 1) * (slack - big_d))
        )
    return x + big_d + big_e


def step_scalars(rec: Recorder, st: Step) -> None:
    """Step-level, blocking: the Z-replicated vectors' gradients (``vector_el * 4`` bytes) over Z
    then data (not over data when they rode in the last bucket: :attr:`Step.vectors_in_buckets`),
    the loss scalar (4 B) over Z and data, the gradient norm (8 B, float64) over the world unless
    only the data axis is above 1 (every rank then has the whole gradient). With the sharded
    optimizer the vectors' sum over data is a reduce-scatter, their all-gather follows the
    update, and the norm is always summed over the world (each rank holds its pieces).

    Under sequence parallelism the norm weights' gradients are summed over Y too (each Y rank
    normalised its own tokens), after Z and before data
    (:func:`tetrad.parallel.grads.sync_gradients`): an all-reduce of ``pv``, or, when they rode
    in the sharded optimizer's buckets, of this rank's pieces, ``ceil(h / (G_x G_data))``
    elements of each of the ``2 L + 1`` norms (:mod:`tetrad.parallel.zero`)."""
    pv = st.vector_el * FP32
    if st.sizes[Axis.Z] > 1:
        t = st.links[Axis.Z].time(ALL_REDUCE, pv)
        rec.add("norm_gradients", "step", Axis.Z, ALL_REDUCE, pv, 1, t, t)
    if st.sequence_parallel:
        py = pv
        if st.zero and st.vectors_in_buckets:
            norms, g = 2 * st.n_layers + 1, st.sizes[Axis.DATA]
            hx = st.model.dim // st.sizes[Axis.X]
            py = norms * -(-hx // g) * FP32
        t = st.links[Axis.Y].time(ALL_REDUCE, py)
        rec.add("norm_gradients", "step", Axis.Y, ALL_REDUCE, py, 1, t, t)
    if st.sizes[Axis.DATA] > 1 and not st.vectors_in_buckets:
        kind = REDUCE_SCATTER if st.zero else ALL_REDUCE
        t = st.links[Axis.DATA].time(kind, pv)
        rec.add("norm_gradients", "step", Axis.DATA, kind, pv, 1, t, t)
    if not st.vectors_in_buckets:
        parameter_gathers(rec, st, "norm_parameters", pv * st.param_bytes / FP32, 1)
    for ax in (Axis.Z, Axis.DATA):
        if st.sizes[ax] > 1:
            t = st.links[ax].time(ALL_REDUCE, FP32)
            rec.add("loss_scalar", "step", ax, ALL_REDUCE, FP32, 1, t, t)
    if st.world > st.sizes[Axis.DATA] or (st.zero and st.sizes[Axis.DATA] > 1):
        t = st.links["world"].time(ALL_REDUCE, 8)
        rec.add("grad_norm", "step", "world", ALL_REDUCE, 8, 1, t, t)
