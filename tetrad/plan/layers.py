"""The collectives of one optimizer step, one function per layer kind (the model is stated in
the module doc of :mod:`tetrad.plan.comm`).

Each function takes a :class:`Recorder` and a :class:`Step` and records the collectives of one
kind of layer: bytes per call, calls per step, seconds per call (alpha-beta,
:meth:`tetrad.plan.network.Link.time`) and exposed seconds per step. The block Linears use
:func:`forward_all_reduce` (which picks the overlap model of the forward all-reduce:
:func:`plain_all_reduce` or :func:`domino_all_reduce`) and :func:`backward_all_reduce`; the LM
head (:func:`lm_head`) all-reduces no logits. The Z collectives are in :mod:`tetrad.plan.zwindows`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tetrad.plan.compute import BlockCompute
from tetrad.plan.fine import fine_all_reduce
from tetrad.plan.models import Linear, ModelSpec
from tetrad.plan.network import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Link
from tetrad.spec import COMM_AXES, FP32, Axis


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


class Recorder:
    """Collects the collectives of one step: per axis, all seconds (``total``) and exposed
    seconds (``exposed``); with ``detail``, one row per ``(layer, phase, axis, kind)``."""

    def __init__(self, detail: bool):
        self.total = dict.fromkeys(COMM_AXES, 0.0)
        self.exposed = dict.fromkeys(COMM_AXES, 0.0)
        self.rows: dict | None = {} if detail else None
        """``(layer, phase, axis, kind) -> [payload bytes, calls, seconds per call, hidden
        behind, exposed seconds]``, in first-recorded order."""

    def add(
        self,
        layer: str,
        phase: str,
        axis: str,
        kind: str,
        payload: float,
        calls: int,
        t: float,
        exposed: float,
        hidden: str = "",
    ) -> None:
        """Record ``calls`` per step of one collective of ``payload`` bytes and ``t`` seconds
        per call, ``exposed`` seconds per step of which the compute waits for."""
        self.total[axis] += calls * t
        self.exposed[axis] += exposed
        if self.rows is not None and calls:
            self._row((layer, phase, axis, kind), payload, calls, t, hidden, exposed)

    def _row(self, key: tuple, payload: float, calls: int, t: float, hidden: str, exposed: float):
        old = self.rows.get(key)
        if old is None:
            self.rows[key] = [payload, calls, t, hidden, exposed]
        else:
            old[1] += calls
            old[4] += exposed

    def merge(self, other: Recorder) -> None:
        """Add ``other``'s seconds and rows to this record."""
        for ax in COMM_AXES:
            self.total[ax] += other.total[ax]
            self.exposed[ax] += other.exposed[ax]
        if self.rows is not None and other.rows is not None:
            for key, row in other.rows.items():
                self._row(key, *row)


@dataclass(slots=True)  # not frozen: built per estimate, and frozen init costs ~1 us a record
class Step:
    """What one :func:`tetrad.plan.comm.estimate` call needs, computed once.

    Attributes:
        model, linears: the model and its block Linears (execution order).
        sizes: ``x y z data`` -> group size; ``links``: the same and ``world`` -> :class:`Link`.
        m: tokens per micro-batch per rank (``micro_batch * seq_len``); ``acc``: micro-batches
            per step; ``c``: compute dtype bytes; ``checkpointing``: blocks recomputed with
            their collectives (``full`` checkpointing; ``selective`` re-runs no collective).
        comp: compute seconds of one micro-batch.
        block_el, head_el, emb_el, vector_el: local parameter elements (one block's weights,
            the LM head, the embedding tables, the Z-replicated vectors of the whole model).
        bucket_calls: data-parallel buckets per step (``dp_overlap`` only).
        prefetch ... dp_overlap: the overlaps in force (``domino`` only when ``m`` is large).
        kv_payload: bytes of one context K/V all-gather (0 without context parallelism).
        fine: the ``fine`` overlap's chunk counts to try (0: ``fine`` off); the block Linears
            are recorded with the one of least exposed time, kept in ``fine_chosen``.
        gemm_s: seconds of one GEMM of the given FLOPs; ``slowdown``: the machine's
            ``overlap_slowdown`` (both for :mod:`tetrad.plan.fine`).
    """

    model: ModelSpec
    linears: list[Linear]
    sizes: dict[str, int]
    links: dict[str, Link]
    m: int
    acc: int
    c: int
    checkpointing: bool
    comp: BlockCompute
    block_el: float
    head_el: float
    emb_el: float
    vector_el: float
    bucket_calls: int
    prefetch: bool
    async_scatter: bool
    dx_overlap: bool
    domino: bool
    dp_overlap: bool
    fine: tuple[int, ...] = ()
    gemm_s: Callable[[float], float] | None = None
    slowdown: float = 0.0
    fine_chosen: int = 0
    kv_payload: float = 0.0

    @property
    def n_layers(self) -> int:
        """Blocks ``L``."""
        return self.model.n_layers

    @property
    def vectors_in_buckets(self) -> bool:
        """Whether the vectors' data-parallel sum rides in the last bucket (the runtime's
        :meth:`tetrad.parallel.overlap.Overlap.folds_late`: ``dp_overlap``, data > 1, ``G_z =
        1``)."""
        return self.dp_overlap and self.sizes["data"] > 1 and self.sizes["z"] == 1

    @property
    def xy(self) -> int:
        """``G_x G_y``: a weight's shard over X and Y."""
        return self.sizes["x"] * self.sizes["y"]

    @property
    def world(self) -> int:
        """Ranks of the grid."""
        s = self.sizes
        return s["data"] * s["z"] * s["y"] * s["x"]  # data: the data x context group


@dataclass(slots=True)
class PlacedLinear:
    """A Linear ``[n, k]`` as one step runs it (module doc).

    Attributes:
        in_axis: its input's axis (the forward all-reduce's); ``out_axis``: the backward dx's.
        calls: calls per step of each of its X/Y collectives.
        gemm: seconds of one of its GEMMs (forward = dx = dW) per micro-batch; ``flops``: its
            FLOPs.
        phases: the phases that run its forward: ``("forward",)`` or with ``"recompute"``.
    """

    name: str
    in_axis: str
    out_axis: str
    n: int
    k: int
    calls: int
    gemm: float
    flops: float
    phases: tuple[str, ...]


def place(lin: Linear, calls: int, gemm: float, flops: float, recomputed: bool) -> PlacedLinear:
    """``lin`` with its axes: X in, Y out; swapped when transposed."""
    in_ax, out_ax = ("y", "x") if lin.transposed else ("x", "y")
    phases = ("forward", "recompute") if recomputed else ("forward",)
    return PlacedLinear(
        lin.name, in_ax, out_ax, lin.out_features, lin.in_features, calls, gemm, flops, phases
    )


# ---- X/Y collectives of the block Linears and the LM head --------------------------------------


def forward_all_reduce(rec: Recorder, st: Step, lin: PlacedLinear, fine: int = 0) -> None:
    """The all-reduce of ``lin``'s output ``m n / G_out * c`` bytes over its input axis, in every
    forward phase. The one place that picks its overlap model (``fine``: chunks, 0 for off)."""
    g = st.sizes[lin.in_axis]
    if g > 1:
        if fine and st.m % g == 0:
            p = st.m * lin.n / st.sizes[lin.out_axis] * st.c
            for phase in lin.phases:
                fine_all_reduce(rec, st, lin, phase, lin.in_axis, p, fine, False)
        else:
            overlap = domino_all_reduce if st.domino else plain_all_reduce
            overlap(rec, st, lin)


def plain_all_reduce(rec: Recorder, st: Step, lin: PlacedLinear) -> None:
    """Blocking forward all-reduce: every second exposed."""
    p = st.m * lin.n / st.sizes[lin.out_axis] * st.c
    t = st.links[lin.in_axis].time(ALL_REDUCE, p)
    for phase in lin.phases:
        rec.add(lin.name, phase, lin.in_axis, ALL_REDUCE, p, lin.calls, t, lin.calls * t)


def domino_all_reduce(rec: Recorder, st: Step, lin: PlacedLinear) -> None:
    """Domino (arXiv 2409.15241; on when ``m >= 2 * domino_min_rows``): the GEMM in two halves
    of rows; the first half's all-reduce runs during the second half's GEMM: exposed
    ``t_2 + max(0, t_1 - GEMM/2)`` seconds."""
    m, g_out, c = st.m, st.sizes[lin.out_axis], st.c
    r1 = m // 2
    p1, p2 = r1 * lin.n / g_out * c, (m - r1) * lin.n / g_out * c
    link = st.links[lin.in_axis]
    t1, t2 = link.time(ALL_REDUCE, p1), link.time(ALL_REDUCE, p2)
    e1 = _max0(t1 - lin.gemm * (m - r1) / m)
    ax, calls = lin.in_axis, lin.calls
    for phase in lin.phases:
        hid = "second-half GEMM (Domino)"
        rec.add(f"{lin.name} (half 1)", phase, ax, ALL_REDUCE, p1, calls, t1, calls * e1, hid)
        rec.add(f"{lin.name} (half 2)", phase, ax, ALL_REDUCE, p2, calls, t2, calls * t2)


def backward_all_reduce(rec: Recorder, st: Step, lin: PlacedLinear, fine: int = 0) -> None:
    """The dx all-reduce ``m k / G_in * c`` bytes over the output axis; with ``dx_all_reduce``
    it runs during the dW GEMM: exposed ``max(0, t - GEMM)`` seconds (``fine``: chunks of
    :func:`fine_all_reduce`, 0 for off)."""
    g = st.sizes[lin.out_axis]
    if g > 1:
        p = st.m * lin.k / st.sizes[lin.in_axis] * st.c
        if fine and st.m % g == 0:
            fine_all_reduce(rec, st, lin, "backward", lin.out_axis, p, fine, st.dx_overlap)
            return
        t = st.links[lin.out_axis].time(ALL_REDUCE, p)
        e = _max0(t - lin.gemm) if st.dx_overlap else t
        hid = "dW GEMM" if st.dx_overlap else ""
        rec.add(lin.name, "backward", lin.out_axis, ALL_REDUCE, p, lin.calls, t, lin.calls * e, hid)


def block_linears(rec: Recorder, st: Step) -> None:
    """X/Y all-reduces of every block Linear, ``L acc count`` calls each (and recompute). With
    several ``fine`` candidates, each is recorded aside and the least exposed one kept."""
    calls = st.n_layers * st.acc
    placed = [
        place(lin, calls * lin.count, gemm, flops, st.checkpointing)
        for lin, gemm, flops in zip(st.linears, st.comp.gemm, st.comp.gemm_flops, strict=True)
    ]
    if len(st.fine) <= 1:
        st.fine_chosen = st.fine[0] if st.fine else 0
        for lin in placed:
            forward_all_reduce(rec, st, lin, st.fine_chosen)
            backward_all_reduce(rec, st, lin, st.fine_chosen)
        return
    best = None
    for chunks in st.fine:
        trial = Recorder(rec.rows is not None)
        for lin in placed:
            forward_all_reduce(trial, st, lin, chunks)
            backward_all_reduce(trial, st, lin, chunks)
        exposed = sum(trial.exposed.values())
        if best is None or exposed < best[0]:
            best = (exposed, chunks, trial)
    st.fine_chosen = best[1]
    rec.merge(best[2])


def context_kv(rec: Recorder, st: Step) -> None:
    """Context parallelism (tetrad/parallel/context.py): per block and micro-batch an all-gather
    of K and V over context (``kv_payload``, the output), again in recompute under full
    checkpointing, and a reduce-scatter of their gradients in backward (the same payload, the
    input); blocking."""
    if st.sizes["context"] == 1:
        return
    p, link, n = st.kv_payload, st.links["context"], st.n_layers * st.acc
    t = link.time(ALL_GATHER, p)
    rec.add("attention_kv", "forward", "context", ALL_GATHER, p, n, t, n * t)
    if st.checkpointing:
        rec.add("attention_kv", "recompute", "context", ALL_GATHER, p, n, t, n * t)
    t = link.time(REDUCE_SCATTER, p)
    rec.add("attention_kv", "backward", "context", REDUCE_SCATTER, p, n, t, n * t)


def lm_head(rec: Recorder, st: Step) -> None:
    """The LM head (tetrad/parallel/head.py: vocabulary over Y and X, input gathered over X),
    ``acc`` calls each, never recomputed; no collective grows with ``V``. Forward: all-gather
    over X of its input, payload ``m h c`` (the output). Backward: reduce-scatter over X of the
    input gradient, payload ``m h c`` (the input), then all-reduce over Y of ``m h / G_x * c``
    (with ``dx_all_reduce`` during the scaling of the head's ``dW``, which the fused loss formed
    in forward: exposed ``max(0, t - scaling)``)."""
    m, h, c, acc = st.m, st.model.hidden, st.c, st.acc
    gx, gy = st.sizes["x"], st.sizes["y"]
    if gx > 1:
        p = m * h * c
        t = st.links["x"].time(ALL_GATHER, p)
        rec.add("output", "forward", "x", ALL_GATHER, p, acc, t, acc * t)
        t = st.links["x"].time(REDUCE_SCATTER, p)
        rec.add("output", "backward", "x", REDUCE_SCATTER, p, acc, t, acc * t)
    if gy > 1:
        p = m * h / gx * c
        t = st.links["y"].time(ALL_REDUCE, p)
        e = _max0(t - st.comp.head_dw_scale) if st.dx_overlap else t
        hid = "dW scaling" if st.dx_overlap else ""
        rec.add("output", "backward", "y", ALL_REDUCE, p, acc, t, acc * e, hid)


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
    """Embedding lookups (token table, GPT: position table): all-reduce ``m h / G_x * 4`` bytes
    (fp32) over Y per table and micro-batch."""
    if st.sizes["y"] > 1:
        p = st.m * st.model.hidden / st.sizes["x"] * FP32
        t = st.links["y"].time(ALL_REDUCE, p)
        rec.add("embedding", "forward", "y", ALL_REDUCE, p, st.acc, t, st.acc * t)
        if st.model.max_positions:
            rec.add("positions", "forward", "y", ALL_REDUCE, p, st.acc, t, st.acc * t)


def norms(rec: Recorder, st: Step) -> None:
    """Norm statistics: all-reduce ``m * 4`` bytes (GPT LayerNorm: ``m * 8``) over X, ``2 L + 1``
    per micro-batch forward and backward, ``2 L`` in recompute."""
    if st.sizes["x"] > 1:
        p = st.m * FP32 * (2 if st.model.family == "gpt" else 1)
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
    the embedding's gradient (:attr:`Step.vectors_in_buckets`)."""
    if st.sizes["data"] == 1:
        return
    ld, L = st.links["data"], st.n_layers
    vec = st.vector_el if st.vectors_in_buckets else 0.0
    w_total = (L * st.block_el + st.head_el + st.emb_el + vec) * FP32
    if not st.dp_overlap:
        t = ld.time(ALL_REDUCE, w_total)
        rec.add("gradients", "step", "data", ALL_REDUCE, w_total, 1, t, t)
        return
    calls = st.bucket_calls
    lat = ld.time(ALL_REDUCE, 0.0)
    per_byte = (ld.time(ALL_REDUCE, w_total) - lat) / w_total
    rate = calls / w_total * lat + per_byte  # seconds per byte, latency spread over the bytes
    big_d = st.block_el * FP32 * rate
    big_h, big_e = st.head_el * FP32 * rate, (st.emb_el + vec) * FP32 * rate
    slack = st.comp.block_bwd + (st.comp.block_fwd if st.checkpointing else 0.0)
    x = _max0(big_h - slack)
    if L > 1:
        x = (
            x + (L - 1) * (big_d - slack)
            if big_d >= slack
            else _max0(x - (L - 1) * (slack - big_d))
        )
    exp = x + big_d + big_e
    t = ld.time(ALL_REDUCE, w_total / calls)
    hid = "backward of the blocks below (last micro-batch, buckets)"
    rec.add("gradients", "backward", "data", ALL_REDUCE, w_total / calls, calls, t, exp, hid)


def step_scalars(rec: Recorder, st: Step) -> None:
    """Step-level, blocking: the Z-replicated vectors' gradients (``vector_el * 4`` bytes) over Z
    then data (not over data when they rode in the last bucket: :attr:`Step.vectors_in_buckets`),
    the loss scalar (4 B) over Z and data, the gradient norm (8 B, float64) over the world unless
    only the data axis is above 1 (every rank then has the whole gradient)."""
    pv = st.vector_el * FP32
    for ax in (Axis.Z, Axis.DATA):
        if st.sizes[ax] > 1 and not (ax == Axis.DATA and st.vectors_in_buckets):
            t = st.links[ax].time(ALL_REDUCE, pv)
            rec.add("norm_gradients", "step", ax, ALL_REDUCE, pv, 1, t, t)
    for ax in (Axis.Z, Axis.DATA):
        if st.sizes[ax] > 1:
            t = st.links[ax].time(ALL_REDUCE, FP32)
            rec.add("loss_scalar", "step", ax, ALL_REDUCE, FP32, 1, t, t)
    if st.world > st.sizes[Axis.DATA]:
        t = st.links["world"].time(ALL_REDUCE, 8)
        rec.add("grad_norm", "step", "world", ALL_REDUCE, 8, 1, t, t)
