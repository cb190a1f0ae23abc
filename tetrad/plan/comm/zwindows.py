"""The Z axis's queue walked through the compute windows of one micro-batch (the ``prefetch`` and
``reduce_scatter`` overlaps of :mod:`tetrad.plan.comm.estimate`, whose module doc states the
model).

Collectives on one axis share one communicator, hence one stream, and run in issue order. A
window is a layer's compute (its GEMMs and the element-wise work up to the next Linear); its Z
queue holds the reduce-scatter issued at the end of the previous window (``reduce_scatter`` on)
and then the prefetch of the next weight in execution order (forward, recompute, backward). The
compute stalls by ``max(0, rs + ag - window)`` seconds, shared between the two in proportion to
their times; without ``prefetch`` the window hides nothing. Blocks are alike (steady state): the
top block, ``L - 2`` middle blocks (one walk, weighted ``L - 2``) and the bottom block. The
embedding's weight is never prefetched; the reduce-scatters left when the bottom block's
backward ends run behind the embedding's backward.

:class:`ZWindows` gives the exposed seconds per micro-batch, per ``(layer, phase)`` key;
:func:`z_collectives` records every Z collective of the step with them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.compute.block import BlockCompute
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER
from tetrad.spec import FP32

Key = tuple[str, str]
"""``(layer, phase)``: ``("wqkv", "forward")``, ``("output", "backward")`` ..."""


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


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
    """Exposed seconds of the Z all-gathers and reduce-scatters of one micro-batch.

    After :meth:`run`, ``gather[key]`` and ``scatter[key]`` hold the seconds per micro-batch
    the compute waits for the all-gathers and reduce-scatters of ``key = (layer, phase)``
    (reduce-scatters are keyed ``(layer, "backward")``).

    Args:
        comp: compute seconds of this rank for one micro-batch.
        times: seconds per call of the Z collectives.
        n_layers: blocks ``L``.
        checkpointing: recompute windows run before each block's backward.
        prefetch: the ``prefetch`` overlap (an all-gather runs during the previous window).
        async_scatter: the ``reduce_scatter`` overlap (reduce-scatters are queued, not blocking).
    """

    def __init__(
        self,
        comp: BlockCompute,
        times: ZTimes,
        n_layers: int,
        *,
        checkpointing: bool,
        prefetch: bool,
        async_scatter: bool,
    ):
        self.comp, self.t, self.n_layers = comp, times, n_layers
        self.ckpt, self.pre, self.rsa = checkpointing, prefetch, async_scatter
        n = len(times.names)
        g = comp.gemm
        self.fwin = [g[i] + comp.post_fwd[i] for i in range(n)]
        self.bwin = [2.0 * g[i] + comp.post_bwd[i - 1] for i in range(n)]
        # (key, seconds) of every block Linear's all-gather per phase and reduce-scatter
        self.ag = {
            phase: [((name, phase), t) for name, t in zip(times.names, times.gather, strict=True)]
            for phase in ("forward", "recompute", "backward")
        }
        self.rs = [
            ((name, "backward"), t) for name, t in zip(times.names, times.scatter, strict=True)
        ]
        self.gather: dict[Key, float] = {}
        self.scatter: dict[Key, float] = {}
        # (key, seconds) of the reduce-scatter still queued on Z as a backward window ends
        self.carry: tuple[Key | None, float] = (None, 0.0)

    # ---- one window ---------------------------------------------------------------------------

    def window(
        self, cwin: float, rs: tuple[Key | None, float], ag: tuple[Key, float] | None, mult: float
    ) -> float:
        """One window of ``cwin`` seconds (``mult`` such windows) with the reduce-scatter ``rs =
        (key, seconds)`` issued at its start and the prefetch ``ag`` it must complete; returns
        the reduce-scatter seconds carried past the window when no all-gather waits at its end
        (``ag`` None).

        With ``prefetch`` the runtime issues the reduce-scatter after the prefetch
        (:meth:`tetrad.parallel.overlap.Overlap.reduce_weight_grad`): the queue is what the
        previous window left (:attr:`carry`), the all-gather, then the reduce-scatter, which
        may run on into the next window. Without it the all-gather blocks at the window's end
        behind the reduce-scatter."""
        rs_key, rs_t = rs
        if not self.rsa:
            rs_t = 0.0
        if not self.pre:
            if ag is not None:
                self._stall(_max0(rs_t + ag[1]), (rs_key, rs_t), ag, mult)
            return _max0(rs_t - cwin) if ag is None else 0.0
        c_key, c_t = self.carry
        if ag is None:  # nothing waits at the window's end: the queue carries over
            self.carry = (None, 0.0)
            return _max0(c_t + rs_t - cwin)
        stall = _max0(c_t + ag[1] - cwin)
        self._stall(stall, (c_key, c_t), ag, mult)
        left = rs_t if stall > 0.0 else _max0(c_t + ag[1] + rs_t - cwin)
        self.carry = (rs_key, left)
        return 0.0

    def _stall(self, stall: float, rs: tuple[Key | None, float], ag: tuple[Key, float], mult):
        """Share ``stall`` seconds (``mult`` windows) between the reduce-scatter ahead of the
        all-gather and the all-gather, in proportion to their seconds."""
        if stall <= 0.0:
            return
        (rs_key, rs_t), (ag_key, ag_t) = rs, ag
        tot = rs_t + ag_t
        if rs_key is not None and rs_t > 0.0:
            self.scatter[rs_key] = self.scatter.get(rs_key, 0.0) + mult * stall * rs_t / tot
        self.gather[ag_key] = self.gather.get(ag_key, 0.0) + mult * stall * ag_t / tot

    # ---- what comes next in execution order ---------------------------------------------------

    def _after_backward(self) -> tuple[Key, float]:
        """The all-gather that follows a block's backward: the block below's recompute, or its
        last Linear's backward."""
        return self.ag["recompute"][0] if self.ckpt else self.ag["backward"][-1]

    # ---- one block ----------------------------------------------------------------------------

    def _forward(self, mult: float, top: bool) -> None:
        """Forward windows; the top block's last one prefetches the LM head. No
        reduce-scatter is queued in forward: the backward's queue (walked out of execution
        order, block by block) is set aside meanwhile."""
        n, ag = len(self.t.names), self.ag["forward"]
        carry, self.carry = self.carry, (None, 0.0)
        for i in range(n - 1):
            self.window(self.fwin[i], (None, 0.0), ag[i + 1], mult)
        last = (("output", "forward"), self.t.head_gather) if top else ag[0]
        self.window(self.fwin[n - 1], (None, 0.0), last, mult)
        self.carry = carry

    def _recompute(self, mult: float, rs_above: tuple[Key, float]) -> None:
        """Recompute windows: the first carries the reduce-scatter of the layer above."""
        n, ag = len(self.t.names), self.ag["recompute"]
        for i in range(n):
            rs = rs_above if i == 0 else (None, 0.0)
            nxt = ag[i + 1] if i < n - 1 else self.ag["backward"][i]
            self.window(self.fwin[i], rs, nxt, mult)

    def _backward(self, mult: float, rs_above: tuple[Key, float], bottom: bool) -> float:
        """Backward windows, last Linear first; returns the bottom block's carried-over
        reduce-scatter seconds."""
        n, ag = len(self.t.names), self.ag["backward"]
        carry = 0.0
        for i in range(n - 1, -1, -1):
            if i == n - 1:
                rs = (None, 0.0) if self.ckpt else rs_above
            else:
                rs = self.rs[i + 1]
            if i >= 1:
                self.window(self.bwin[i], rs, ag[i - 1], mult)
            elif bottom:
                carry = self.window(self.bwin[i], rs, None, mult)
            else:
                self.window(self.bwin[i], rs, self._after_backward(), mult)
        return carry

    def _block(self, mult: float, top: bool, bottom: bool) -> float:
        """Windows of one block (``mult`` such blocks); returns the carried-over seconds."""
        self._forward(mult, top)
        if top:
            rs_above = (("output", "backward"), self.t.head_scatter)
        else:
            rs_above = self.rs[0]
        if self.ckpt:
            self._recompute(mult, rs_above)
        return self._backward(mult, rs_above, bottom)

    # ---- one micro-batch ----------------------------------------------------------------------

    def run(self) -> ZWindows:
        """Walk one micro-batch: embedding, blocks, LM head, tail; returns self."""
        comp, n = self.comp, len(self.t.names)
        # embedding window: block 1's first weight is prefetched behind the lookup and first norm
        emb_win = comp.embedding_fwd + comp.post_fwd[n - 1] * 0.5
        self.window(emb_win, (None, 0.0), self.ag["forward"][0], 1.0)
        L = self.n_layers
        if L == 1:
            carry = self._block(1.0, True, True)
        else:
            self._block(1.0, True, False)
            if L > 2:
                self._block(float(L - 2), False, False)
            carry = self._block(1.0, False, True)
        # LM head: its gathered weight is kept for backward, so the next all-gather (the top
        # block's backward or recompute) runs behind head forward, loss and head backward
        head = 3.0 * comp.head + comp.loss_fwd + comp.loss_bwd + comp.final_norm_bwd
        self.window(head, (None, 0.0), self._after_backward(), 1.0)
        if self.rsa:
            self._tail(carry)
        return self

    def _tail(self, carry: float) -> None:
        """Block 1's first reduce-scatter and the carried-over ones behind the embedding's
        backward; what is left is exposed."""
        t, n = self.t, len(self.t.names)
        tail = _max0(carry + t.scatter[0] - self.comp.embedding_bwd)
        k1 = (t.names[1 % n], "backward")
        part = tail * carry / (carry + t.scatter[0]) if carry > 0.0 else 0.0
        self.scatter[k1] = self.scatter.get(k1, 0.0) + part
        k0 = (t.names[0], "backward")
        self.scatter[k0] = self.scatter.get(k0, 0.0) + tail - part


# ---- recording: every Z collective of the step ---------------------------------------------------


@dataclass(slots=True)
class ZWeight:
    """One weight's Z collectives: ``shard = n k / (G_x G_y)`` elements all-gathered (compute
    dtype) in every phase of ``phases`` and reduce-scattered (fp32) in backward; ``calls`` per
    step of each; ``gather_s`` and ``scatter_s`` seconds per call."""

    name: str
    shard: float
    calls: int
    phases: tuple[str, ...]
    gather_s: float
    scatter_s: float


def _z_weight(st: Step, name: str, nk: int, calls: int, phases: tuple[str, ...]) -> ZWeight:
    lz, shard = st.links["z"], nk / st.xy
    t_ag, t_rs = lz.time(ALL_GATHER, shard * st.c), lz.time(REDUCE_SCATTER, shard * FP32)
    return ZWeight(name, shard, calls, phases, t_ag, t_rs)


def z_collectives(rec: Recorder, st: Step) -> None:
    """Z all-gathers and reduce-scatters of every block Linear and the LM head, exposed seconds
    from the window schedule (:class:`ZWindows`); then the tables'."""
    if st.sizes["z"] == 1:
        return
    blocks, head, times = _z_weights(st)
    sched = ZWindows(
        st.comp,
        times,
        st.n_layers,
        checkpointing=st.checkpointing,
        prefetch=st.prefetch,
        async_scatter=st.async_scatter,
    ).run()
    for w in (*blocks, head):
        _z_record(rec, st, sched, w)
    z_tables(rec, st)


def _z_weights(st: Step) -> tuple[list[ZWeight], ZWeight, ZTimes]:
    """The Z collectives of every block Linear and of the LM head, and their seconds per call."""
    L, acc, model = st.n_layers, st.acc, st.model
    phases = ("forward", "recompute", "backward") if st.checkpointing else ("forward", "backward")
    blocks = [
        _z_weight(st, lin.name, lin.weight_elements * lin.count, L * acc * lin.count, phases)
        for lin in st.linears
    ]
    head = _z_weight(st, "output", model.hidden * model.vocab, acc, ("forward",))  # kept for bwd
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
    """Record one weight's Z collectives with the schedule's exposed seconds; all of them are
    exposed without ``prefetch`` (the all-gather blocks, and so does a reduce-scatter queued
    ahead of it), the reduce-scatter's also without ``reduce_scatter``."""
    acc, pre = st.acc, st.prefetch
    hid = "previous layer's compute (prefetch)" if pre else ""
    for phase in w.phases:
        exp = acc * sched.gather.get((w.name, phase), 0.0) if pre else w.calls * w.gather_s
        rec.add(w.name, phase, "z", ALL_GATHER, w.shard * st.c, w.calls, w.gather_s, exp, hid)
    hid = "later backward compute (async)" if st.async_scatter else ""
    overlapped = st.async_scatter and pre
    exp = (
        acc * sched.scatter.get((w.name, "backward"), 0.0) if overlapped else w.calls * w.scatter_s
    )
    pay = w.shard * FP32
    rec.add(w.name, "backward", "z", REDUCE_SCATTER, pay, w.calls, w.scatter_s, exp, hid)


def z_tables(rec: Recorder, st: Step) -> None:
    """Embedding tables (token; GPT: positions): ``rows h / (G_x G_y)`` elements all-gathered
    forward (compute dtype, as the Linears' weights) and reduce-scattered backward (fp32) over
    Z, never overlapped."""
    model = st.model
    tables = [("embedding", model.vocab)]
    if model.max_positions:
        tables.append(("positions", model.max_positions))
    lz = st.links["z"]
    for tab, rows in tables:
        shard = rows * model.hidden / st.xy
        t_g, t_r = lz.time(ALL_GATHER, shard * st.c), lz.time(REDUCE_SCATTER, shard * FP32)
        rec.add(tab, "forward", "z", ALL_GATHER, shard * st.c, st.acc, t_g, st.acc * t_g)
        rec.add(tab, "backward", "z", REDUCE_SCATTER, shard * FP32, st.acc, t_r, st.acc * t_r)
