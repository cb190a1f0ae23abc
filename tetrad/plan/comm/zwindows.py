"""Every Z collective of one optimizer step and what of it is exposed (the ``prefetch`` and
``reduce_scatter`` overlaps of :mod:`tetrad.plan.step_time`, whose module doc states the
model): the uses of the Z-gathered weights in execution order (:class:`ZWindows`), replayed on
the Z stream by :class:`tetrad.plan.comm.zqueue.ZQueue`; :func:`z_collectives` records them.
:func:`z_queue_seconds` and :func:`window_seconds` bound the replay from below for the search.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.comm.zqueue import Use, ZQueue
from tetrad.plan.compute.block import BlockCompute
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.spec.units import FP32


@dataclass(slots=True)
class ZTimes:
    """Seconds of one call of each Z collective of one micro-batch.

    Attributes:
        names: the block Linears, in execution order.
        gather: per block Linear, its weight all-gather (compute dtype).
        scatter: per block Linear, its gradient reduce-scatter (fp32).
        head_gather: the LM head's all-gather.
        head_scatter: the LM head's reduce-scatter.
    """

    names: tuple[str, ...]
    gather: tuple[float, ...]
    scatter: tuple[float, ...]
    head_gather: float
    head_scatter: float


class ZWindows:
    """The uses of one micro-batch (:class:`tetrad.plan.comm.zqueue.Use`) in execution order,
    walked on the Z stream (:class:`~tetrad.plan.comm.zqueue.ZQueue`).

    Windows: a forward use's is its Linear's GEMM and the element-wise work up to the next
    Linear; a backward use's its two GEMMs and the element-wise backward below it; the
    tables' the embedding lookup and half the first norm; the LM head's its three GEMMs, the
    loss forward and backward and the final norm's backward. Blocks are alike (steady state):
    the bottom block, the first middle block, ``L - 3`` middle blocks (walked once, weighted
    ``L - 3``) and the top block (in forward; the reverse in backward); with ``full``
    checkpointing a block's recompute uses precede its backward ones. The tail is the
    embedding's backward, then the tables' reduce-scatters.

    After :meth:`run`, ``gather[key]`` and ``scatter[key]`` hold the exposed seconds per step
    of the all-gathers and reduce-scatters of ``key = (layer, phase)`` (reduce-scatters keyed
    ``(layer, "backward")``), the tables' (``embedding``, ``positions``) among them.

    Args:
        comp: compute seconds of this rank for one micro-batch.
        times: seconds per call of the block Linears' and LM head's Z collectives.
        tables: ``(name, all-gather seconds, reduce-scatter seconds)`` of each embedding table.
        n_layers: blocks ``L``; acc: micro-batches per step.
        checkpointing: recompute uses run before each block's backward.
        prefetch, async_scatter: the ``prefetch`` and ``reduce_scatter`` overlaps.
        wrap: the prefetch order runs on into the step's next micro-batch.
    """

    def __init__(
        self,
        comp: BlockCompute,
        times: ZTimes,
        tables: list[tuple[str, float, float]],
        n_layers: int,
        acc: int,
        *,
        checkpointing: bool,
        prefetch: bool,
        async_scatter: bool,
        wrap: bool = False,
    ):
        self.comp, self.t, self.tables, self.n_layers, self.acc = comp, times, tables, n_layers, acc
        self.ckpt, self.wrap = checkpointing, wrap
        self.queue = ZQueue(prefetch, async_scatter)
        self.gather, self.scatter = self.queue.gather, self.queue.scatter

    def _forward(self, mult: float) -> list[Use]:
        c, t = self.comp, self.t
        return [
            Use((name, "forward"), t.gather[i], c.gemm[i] + c.post_fwd[i], mult=mult)
            for i, name in enumerate(t.names)
        ]

    def _backward(self, mult: float) -> list[Use]:
        c, t, n = self.comp, self.t, len(self.t.names)
        out = []
        if self.ckpt:
            out = [
                Use((name, "recompute"), t.gather[i], c.gemm[i] + c.post_fwd[i], mult=mult)
                for i, name in enumerate(t.names)
            ]
        for i in range(n - 1, -1, -1):
            key = (t.names[i], "backward")
            window = 2.0 * c.gemm[i] + c.post_bwd[i - 1]
            out.append(Use(key, t.gather[i], window, key, t.scatter[i], mult))
        return out

    def uses(self) -> list[Use]:
        """One micro-batch's uses, in execution order."""
        c, t, L = self.comp, self.t, self.n_layers
        n = len(t.names)
        emb_win = c.embedding_fwd + c.post_fwd[n - 1] * 0.5
        out = [
            Use((name, "forward"), ag, emb_win if k == len(self.tables) - 1 else 0.0)
            for k, (name, ag, _) in enumerate(self.tables)
        ]
        # bottom, middle, top; the first middle block apart (the queue it inherits from the
        # bottom block settles to the steady state the others see)
        mults = [1.0] * min(L, 3) if L <= 3 else [1.0, 1.0, float(L - 3), 1.0]
        for mult in mults:
            out += self._forward(mult)
        head = 3.0 * c.head + c.loss_fwd + c.loss_bwd + c.final_norm_bwd
        out.append(
            Use(("output", "forward"), t.head_gather, head, ("output", "backward"), t.head_scatter)
        )
        for mult in mults[-1:] + mults[1:-1] + mults[:1] if L > 1 else mults:
            out += self._backward(mult)
        return out

    def run(self) -> ZWindows:
        """Walk the step's micro-batches (the first and last apart when the order wraps);
        returns self."""
        uses = self.uses()
        tail = [((name, "backward"), rs) for name, _, rs in self.tables]
        emb_bwd, acc, walk = self.comp.embedding_bwd, self.acc, self.queue.micro_batch
        if not (self.wrap and acc > 1):
            walk(uses, emb_bwd, tail, wrap_in=False, wrap_out=False, mult=float(acc))
            return self
        walk(uses, emb_bwd, tail, wrap_in=False, wrap_out=True, mult=1.0)
        if acc > 2:
            walk(uses, emb_bwd, tail, wrap_in=True, wrap_out=True, mult=float(acc - 2))
        walk(uses, emb_bwd, tail, wrap_in=True, wrap_out=False, mult=1.0)
        return self


# ---- recording: every Z collective of the step ---------------------------------------------------


@dataclass(slots=True)
class ZWeight:
    """One weight's Z collectives: ``shard = n k / (G_x G_y)`` elements all-gathered (``wbytes``
    per element: the compute dtype's, FP8's for a block Linear under ``tensorwise``) in every
    phase of ``phases`` and reduce-scattered (fp32) in backward; ``calls`` per step of each;
    ``gather_s`` and ``scatter_s`` seconds per call."""

    name: str
    shard: float
    calls: int
    phases: tuple[str, ...]
    gather_s: float
    scatter_s: float
    wbytes: int


def _z_weight(
    st: Step, name: str, nk: int, calls: int, phases: tuple[str, ...], wbytes: int
) -> ZWeight:
    lz, shard = st.links["z"], nk / st.xy
    t_ag, t_rs = lz.time(ALL_GATHER, shard * wbytes), lz.time(REDUCE_SCATTER, shard * FP32)
    return ZWeight(name, shard, calls, phases, t_ag, t_rs, wbytes)


def z_collectives(rec: Recorder, st: Step) -> None:
    """Z all-gathers and reduce-scatters of every block Linear, the LM head and the embedding
    tables, exposed seconds from the replay of the Z stream (:class:`ZWindows`)."""
    if st.sizes["z"] == 1:
        return
    blocks, head, sched = z_stream(st)
    sched.run()
    for w in (*blocks, head):
        _z_record(rec, st, sched, w)
    z_tables(rec, st, sched)


def z_stream(st: Step) -> tuple[list[ZWeight], ZWeight, ZWindows]:
    """The Z collectives of ``st``'s block Linears and LM head, and the replay of its Z stream
    (:class:`ZWindows`, not yet run: :meth:`ZWindows.run` fills its exposed seconds)."""
    blocks, head, times = _z_weights(st)
    sched = ZWindows(
        st.comp,
        times,
        table_seconds(st),
        st.n_layers,
        st.acc,
        checkpointing=st.checkpointing,
        prefetch=st.prefetch,
        async_scatter=st.async_scatter,
        wrap=st.wrap,
    )
    return blocks, head, sched


def _z_weights(st: Step) -> tuple[list[ZWeight], ZWeight, ZTimes]:
    """The Z collectives of every block Linear and of the LM head, and their seconds per call."""
    L, acc, model = st.n_layers, st.acc, st.model
    phases = ("forward", "recompute", "backward") if st.checkpointing else ("forward", "backward")
    wb = st.z_weight_bytes or st.c
    blocks = [
        _z_weight(st, lin.name, lin.weight_elements * lin.count, L * acc * lin.count, phases, wb)
        for lin in st.linears
    ]
    head = _z_weight(st, "output", model.dim * model.vocab_size, acc, ("forward",), st.c)
    times = ZTimes(
        tuple(w.name for w in blocks),
        tuple(w.gather_s for w in blocks),
        tuple(w.scatter_s for w in blocks),
        head.gather_s,
        head.scatter_s,
    )
    return blocks, head, times


# ---- a lower bound without the walk (the search's pruning) -------------------------------------


def z_queue_seconds(st: Step) -> float:
    """Seconds of the Z collectives one micro-batch queues on the Z stream (0 with ``G_z = 1``):
    each block Linear's all-gather in every phase and its reduce-scatter, ``L`` blocks, and the
    LM head's all-gather and reduce-scatter.

    With :func:`window_seconds` it bounds the walk from below: every one of them runs inside a
    window (or, the reduce-scatters left at the end, behind the embedding's backward), where
    the compute waits ``max(0, queued - window)``; so a micro-batch's exposed Z seconds are at
    least ``queued - sum of the windows`` (and all of the queue without ``prefetch``)."""
    if st.sizes["z"] == 1:
        return 0.0
    _, _, t = _z_weights(st)
    phases = 3 if st.checkpointing else 2
    block = sum(phases * g + s for g, s in zip(t.gather, t.scatter, strict=True))
    return st.n_layers * block + t.head_gather + t.head_scatter


def window_seconds(comp: BlockCompute, n_layers: int, checkpointing: bool) -> float:
    """Compute seconds of one micro-batch's windows in :meth:`ZWindows.run`: the embedding's,
    every block's forward (recompute with ``checkpointing``) and backward, the LM head's, and
    the embedding's backward behind which the last reduce-scatters run."""
    block = comp.block_fwd * (2 if checkpointing else 1) + comp.block_bwd
    head = 3.0 * comp.head + comp.loss_fwd + comp.loss_bwd + comp.final_norm_bwd
    embedding = comp.embedding_fwd + comp.post_fwd[-1] * 0.5 + comp.embedding_bwd
    return n_layers * block + head + embedding


def _z_record(rec: Recorder, st: Step, sched: ZWindows, w: ZWeight) -> None:
    """Record one weight's Z collectives with the replay's exposed seconds."""
    hid = "previous layers' compute (prefetch)" if st.prefetch else ""
    for phase in w.phases:
        exp = sched.gather.get((w.name, phase), 0.0)
        rec.add(w.name, phase, "z", ALL_GATHER, w.shard * w.wbytes, w.calls, w.gather_s, exp, hid)
    hid = "later backward compute (async)" if st.async_scatter else ""
    exp = sched.scatter.get((w.name, "backward"), 0.0)
    pay = w.shard * FP32
    rec.add(w.name, "backward", "z", REDUCE_SCATTER, pay, w.calls, w.scatter_s, exp, hid)


def _tables(st: Step) -> list[tuple[str, float]]:
    """``(name, elements of one Z-gathered block)`` of the embedding tables (token; GPT:
    positions), ``rows h / (G_x G_y)``."""
    model = st.model
    tables = [("embedding", model.vocab_size)]
    if model.max_positions:
        tables.append(("positions", model.max_positions))
    return [(tab, rows * model.dim / st.xy) for tab, rows in tables]


def table_seconds(st: Step) -> list[tuple[str, float, float]]:
    """``(name, all-gather seconds, reduce-scatter seconds)`` of each embedding table: gathered
    in the compute dtype (as the Linears' weights), gradient reduce-scattered in fp32."""
    lz = st.links["z"]
    return [
        (tab, lz.time(ALL_GATHER, shard * st.c), lz.time(REDUCE_SCATTER, shard * FP32))
        for tab, shard in _tables(st)
    ]


def z_tables(rec: Recorder, st: Step, sched: ZWindows | None = None) -> None:
    """Record the embedding tables' Z collectives, one all-gather forward and one
    reduce-scatter backward per micro-batch, with the replay's exposed seconds (``sched``;
    None: all exposed)."""
    acc, times = st.acc, table_seconds(st)
    for (tab, shard), (_, t_g, t_r) in zip(_tables(st), times, strict=True):
        if sched is None:
            e_g, e_r = acc * t_g, acc * t_r
        else:
            e_g = sched.gather.get((tab, "forward"), 0.0)
            e_r = sched.scatter.get((tab, "backward"), 0.0)
        hid = "previous micro-batch's backward (prefetch)" if st.wrap and acc > 1 else ""
        rec.add(tab, "forward", "z", ALL_GATHER, shard * st.c, acc, t_g, e_g, hid)
        rec.add(tab, "backward", "z", REDUCE_SCATTER, shard * FP32, acc, t_r, e_r)
