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
from tetrad.spec.overlap import gather_groups, loss_blocks
from tetrad.spec.units import FP32


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


def context_kv(rec: Recorder, st: Step) -> None:
    """Context parallelism (tetrad/parallel/context.py): per block and micro-batch an all-gather
    of K and V over context (``kv_payload``, the output), again in recompute under full
    checkpointing, and a reduce-scatter of their gradients in backward (the same payload, the
    input); each in ``kv_pieces`` calls of ``1/n`` of the payload, each piece hidden behind the
    attention of the piece before it, the first behind the queries' RoPE, the last
    reduce-scatter behind its backward
    (:func:`tetrad.plan.comm.context_parallel.pieces_exposed_seconds`)."""
    if st.sizes["context"] == 1:
        return
    k, link, n = st.kv_pieces, st.links["context"], st.n_layers * st.acc
    p, hid = st.kv_payload / k, "attention" if k > 1 else ""
    hid = ", ".join(w for w in (hid, "queries' RoPE" if st.comp.rope_q else "") if w)
    t = link.time(ALL_GATHER, p)
    e = n * pieces_exposed_seconds(t, st.comp.attention / k, k, st.comp.rope_q)
    rec.add("attention_kv", "forward", "context", ALL_GATHER, p, n * k, t, e, hid)
    if st.checkpointing:
        rec.add("attention_kv", "recompute", "context", ALL_GATHER, p, n * k, t, e, hid)
    t = link.time(REDUCE_SCATTER, p)
    e = n * pieces_exposed_seconds(t, st.comp.attention_bwd / k, k, st.comp.rope_q_bwd)
    rec.add("attention_kv", "backward", "context", REDUCE_SCATTER, p, n * k, t, e, hid)


def lm_head(rec: Recorder, st: Step) -> None:
    """The LM head (tetrad/parallel/head.py: vocabulary over Y and X, input gathered over X),
    ``acc`` calls each, never recomputed; no collective grows with ``V``. Forward: all-gather
    over X of its input, payload ``m h c`` (the output). Backward: reduce-scatter over X of the
    input gradient, payload ``m h c`` (the input), then all-reduce over Y of ``m h / G_x * c``
    (with ``dx_all_reduce`` during the scaling of the head's ``dW``, which the fused loss formed
    in forward: exposed ``max(0, t - scaling)``; with ``G_z = 1`` there is no scaling, the
    GEMMs put ``dW`` into the gradient in forward:
    :meth:`tetrad.plan.compute.block.BlockCompute.over_step`). Under sequence parallelism the
    input is first all-gathered along the sequence over Y, payload ``m h / G_x c``, and in
    backward that all-reduce over Y is a reduce-scatter of the same payload (hidden as the
    all-reduce was)."""
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
        hid = "dW scaling" if st.dx_overlap and st.comp.head_dw_scale else ""
        rec.add("output", "backward", "y", kind, p, acc, t, acc * e, hid)


# ---- always-exposed all-reduces: loss, embedding, norms ---------------------------------------


def loss(rec: Recorder, st: Step) -> None:
    """Vocabulary-parallel cross-entropy over Y and X: per row block of the fused loss
    (:func:`tetrad.spec.overlap.loss_blocks`, the GPU budget; one block up to ``2^28 /
    (V/(G_y G_x))`` tokens) 3 all-reduces (max, sum of exp, target logit) over each of Y and X,
    ``m * 4`` bytes per statistic over the micro-batch's blocks (each call timed at its mean
    payload), forward only (tetrad/parallel/loss.py)."""
    vy = st.model.vocab_size // (st.sizes["y"] * st.sizes["x"])
    blocks = loss_blocks(vy, st.m)
    for ax in (Axis.Y, Axis.X):
        if st.sizes[ax] > 1:
            p = st.m * FP32 / blocks
            t = st.links[ax].time(ALL_REDUCE, p)
            n = 3 * blocks * st.acc
            rec.add("loss", "forward", ax, ALL_REDUCE, p, n, t, n * t)


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
    update the parameters are all-gathered over data one unit at a time
    (:func:`parameter_gathers`)."""
    if st.sizes["data"] == 1:
        return
    ld, L = st.links["data"], st.n_layers
    kind = REDUCE_SCATTER if st.zero else ALL_REDUCE
    w_total = gradient_bytes(st)
    if not st.dp_overlap:
        t = ld.time(kind, w_total)
        rec.add("gradients", "step", "data", kind, w_total, 1, t, t)
    else:
        calls = st.bucket_calls
        slack = st.comp.block_bwd + (st.comp.block_fwd if st.checkpointing else 0.0)
        exp = bucket_exposed(*bucket_seconds(st), slack, L)
        t = ld.time(kind, w_total / calls)
        hid = "backward of the blocks below (last micro-batch, buckets)"
        rec.add("gradients", "backward", "data", kind, w_total / calls, calls, t, exp, hid)
    parameter_gathers(rec, st)


def gather_units(st: Step) -> list[tuple[str, float, float]]:
    """The units the sharded optimizer all-gathers over data after the update, in the order of
    the next forward (tetrad/parallel/zero.py, ``gather_units``): ``(name, local elements,
    forward seconds between its wait and the next unit's first read)``: the embedding (first
    rank; its lookup counted as nothing), each block (a block's forward; the last block of a
    stage followed by another stage of the rank: ``rounds`` micro-batches through the stage
    first; the stages' blocks ``st.chunk_blocks``, which may be uneven and the head's stage
    empty), the final norm with the LM head (last rank). Every block carries its norms and
    biases (``(vector_el - h / G_x) / L`` elements); the final norm's ``h / G_x`` go with the
    head, or with the last block where the rank has no head."""
    L, fwd = st.n_layers, st.comp.block_fwd
    norm = st.model.norm_params() / st.sizes["x"]
    block = st.block_el + (st.vector_el - norm) / L if L else 0.0  # L = 0: the head's stage alone
    units: list[tuple[str, float, float]] = []
    if st.emb_el:
        units.append(("embedding", st.emb_el, 0.0))
    ends: dict[int, int] = {}  # a stage's last block (followed by another stage): its blocks
    if st.chunk_blocks:
        start = 0
        for b in st.chunk_blocks[:-1]:
            start += b
            if b:
                ends[start - 1] = b
    else:
        per = max(1, -(-L // st.chunks))  # L = 0: no block
        ends = {k: per for k in range(per - 1, L - 1, per)}
    for k in range(L):
        after = fwd * (1 + (st.rounds - 1) * ends[k]) if k in ends else fwd
        units.append(("blocks", block, after))
    if st.head_el:
        units.append(("head", st.head_el + norm, 0.0))
    else:
        name, el, after = units[-1]
        units[-1] = (name, el + norm, after)
    return units


def gather_groups_of(st: Step) -> list[tuple[str, float, float]]:
    """The all-gathers after the update: :func:`gather_units` taken together while their bytes
    in the weights' format stay below :data:`tetrad.spec.overlap.GATHER_GROUP_BYTES`
    (:func:`tetrad.spec.overlap.gather_groups`, as the runtime cuts them): ``(label, local
    elements, forward seconds between its wait and the next group's first read)``, the label
    naming the units it holds (``embedding + 2 blocks``)."""
    units = gather_units(st)
    out = []
    for run in gather_groups([el * st.param_bytes for _, el, _ in units]):
        part = [units[i] for i in run]
        blocks = sum(1 for name, _, _ in part if name == "blocks")
        names = [name for name, _, _ in part if name != "blocks"]
        words = names[:1] if names[:1] == ["embedding"] else []
        if blocks:
            words.append(f"{blocks} block" + ("s" if blocks > 1 else ""))
        words += [n for n in names if n == "head"]
        label = " + ".join(words)
        out.append((label, sum(el for _, el, _ in part), sum(a for _, _, a in part)))
    return out


def parameter_gathers(rec: Recorder, st: Step) -> None:
    """With the sharded optimizer (``G_data G_context > 1``): after the update, one all-gather
    over data per group of units (:func:`gather_groups_of`) of its elements in the weights'
    stored format (:attr:`Step.param_bytes`), one in flight at a time: the first issued by the
    update, each
    next one when the next step's forward waits the one before (Megatron-LM's
    ``overlap_param_gather`` dispatches the next bucket so). A unit's all-gather runs behind
    the forward of the unit before it (:func:`chain_exposed`): the first unit's is exposed
    whole, and so is the one after the embedding (its lookup hides nothing). Not counted: a
    pipeline's fill (later stages start later), and the Z prefetch's lead (it reads a block's
    first weights during the block before, so waits that block's all-gather early, but then
    issues the next one as early)."""
    if not (st.zero and st.sizes["data"] > 1):
        return
    ld = st.links["data"]
    units = gather_groups_of(st)
    times = [ld.time(ALL_GATHER, el * st.param_bytes) for _, el, _ in units]
    exposed = chain_exposed(times, [after for _, _, after in units])
    hid = "the forward of the unit before (next step, first micro-batch)"
    rows: dict[str, list] = {}
    for (name, el, _), t, e in zip(units, times, exposed, strict=True):
        row = rows.setdefault(name, [el * st.param_bytes, 0, t, 0.0])
        row[1] += 1
        row[3] += e
    for name, (payload, calls, t, e) in rows.items():
        rec.add(f"parameters: {name}", "step", "data", ALL_GATHER, payload, calls, t, e, hid)


def chain_exposed(times: list[float], slack: list[float]) -> list[float]:
    """Exposed seconds of each of a chain of collectives issued one at a time, the next when
    the compute waits the one before: ``times[i]`` seconds each, ``slack[i]`` seconds of
    compute between the wait of ``i`` and the first read of ``i + 1``. The first is exposed
    whole, each next ``max(0, times[i + 1] - slack[i])``: it starts when ``i`` is waited,
    whatever ``i``'s own lateness."""
    out = [times[0]] if times else []
    for i in range(1, len(times)):
        out.append(max(0.0, times[i] - slack[i - 1]))
    return out


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
    the loss scalar (4 B) over Z and data (the sum over data left in flight behind the
    gradients' sum and the update: hidden, a few microseconds of latency against milliseconds of
    AdamW; tetrad/train/step.py), the gradient norm (8 B, float64) over the world unless
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
    for ax in (Axis.Z, Axis.DATA):
        if st.sizes[ax] > 1:
            t = st.links[ax].time(ALL_REDUCE, FP32)
            if ax == Axis.DATA:  # left in flight behind the gradients' sum and the update
                rec.add("loss_scalar", "step", ax, ALL_REDUCE, FP32, 1, t, 0.0, "the update")
            else:
                rec.add("loss_scalar", "step", ax, ALL_REDUCE, FP32, 1, t, t)
    if st.world > st.sizes[Axis.DATA] or (st.zero and st.sizes[Axis.DATA] > 1):
        t = st.links["world"].time(ALL_REDUCE, 8)
        rec.add("grad_norm", "step", "world", ALL_REDUCE, 8, 1, t, t)
