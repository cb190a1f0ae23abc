"""The X/Y collectives of the block Linears: the forward all-reduce of each Linear's output over
its input axis and the backward all-reduce of its input gradient over its output axis, with the
overlap model in force: blocking, Domino's halves, ``dx_all_reduce`` behind the dW GEMM, or the
``fine`` reduce-scatter fused with its GEMM (:mod:`tetrad.plan.comm.fine`); a Linear in FP8
runs its GEMM whole, then its collective (no Domino halves, no ``fine`` fusion). The model is stated
in the module doc of :mod:`tetrad.plan.step_time`."""

from __future__ import annotations

from tetrad.plan.comm.record import PlacedLinear, Recorder, Step, place
from tetrad.plan.machine.network import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from tetrad.spec.precision import fp8_converts


def _max0(v: float) -> float:
    return v if v > 0.0 else 0.0


def forward_all_reduce(rec: Recorder, st: Step, lin: PlacedLinear, fine: int = 0) -> None:
    """The all-reduce of ``lin``'s output ``m n / G_out * c`` bytes over its input axis, in every
    forward phase. The one place that picks its overlap model (``fine``: chunks, 0 for off).
    Under sequence parallelism :func:`sequence_forward` first; a second layer's all-reduce over
    Y is its reduce-scatter then."""
    if st.sequence_parallel:
        sequence_forward(rec, st, lin)
        if lin.in_axis == "y":
            return
    g = st.sizes[lin.in_axis]
    if g > 1:
        whole = fp8_converts(st.fp8, lin.n, lin.k)  # an FP8 GEMM runs whole, then its collective
        if fine and st.m % g == 0 and not whole:
            p = st.m * lin.n / st.sizes[lin.out_axis] * st.c
            for phase in lin.phases:
                fine_all_reduce(rec, st, lin, phase, lin.in_axis, p, fine, False)
        else:
            overlap = domino_all_reduce if st.domino and not whole else plain_all_reduce
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
    :func:`fine_all_reduce`, 0 for off). Under sequence parallelism :func:`sequence_backward`
    first; a first layer's all-reduce over Y is its reduce-scatter then."""
    if st.sequence_parallel:
        sequence_backward(rec, st, lin)
        if lin.out_axis == "y":
            return
    g = st.sizes[lin.out_axis]
    if g > 1:
        p = st.m * lin.k / st.sizes[lin.in_axis] * st.c
        if fine and st.m % g == 0 and not fp8_converts(st.fp8, lin.n, lin.k):
            fine_all_reduce(rec, st, lin, "backward", lin.out_axis, p, fine, st.dx_overlap)
            return
        t = st.links[lin.out_axis].time(ALL_REDUCE, p)
        e = _max0(t - lin.gemm) if st.dx_overlap else t
        hid = "dW GEMM" if st.dx_overlap else ""
        rec.add(lin.name, "backward", lin.out_axis, ALL_REDUCE, p, lin.calls, t, lin.calls * e, hid)


def sequence_forward(rec: Recorder, st: Step, lin: PlacedLinear) -> None:
    """Sequence parallelism (tetrad/parallel/sequence.py), in every forward phase, blocking: a
    pair's first Linear (output over Y) all-gathers its input along the sequence over Y,
    payload ``m k / G_x c`` (the output; its all-reduce over X follows as without it); the
    second (input over Y) reduce-scatters its output, payload ``m n / G_x c`` (the input), in
    place of its all-reduce. Neither is split by Domino nor fused by ``fine``."""
    if lin.out_axis == "y":
        kind, p = ALL_GATHER, st.m * lin.k / st.sizes[lin.in_axis] * st.c
    else:
        kind, p = REDUCE_SCATTER, st.m * lin.n / st.sizes[lin.out_axis] * st.c
    t = st.links["y"].time(kind, p)
    for phase in lin.phases:
        rec.add(lin.name, phase, "y", kind, p, lin.calls, t, lin.calls * t)


def sequence_backward(rec: Recorder, st: Step, lin: PlacedLinear) -> None:
    """Sequence parallelism in backward: a pair's first Linear reduce-scatters its input
    gradient along the sequence over Y, payload ``m k / G_x c``, with ``dx_all_reduce`` during
    the dW GEMM (exposed ``max(0, t - GEMM)``), in place of its all-reduce; the second
    all-gathers its output gradient, payload ``m n / G_x c``, before its GEMMs (exposed; its
    input gradient's all-reduce over X follows as without it). With ``sequence_regather`` the
    first Linear all-gathers its saved input shard again first, the forward's payload ``m k /
    G_x c`` once per backward (not in recompute), issued before the dx GEMM and waited before
    the dW GEMM: exposed ``max(0, t - GEMM)`` (Korthikanti et al., arXiv 2205.05198, section
    4.2.2)."""
    if lin.out_axis == "y":
        p = st.m * lin.k / st.sizes[lin.in_axis] * st.c
        if st.sequence_regather:
            t = st.links["y"].time(ALL_GATHER, p)
            e = lin.calls * _max0(t - lin.gemm)
            rec.add(
                f"{lin.name} (input)", "backward", "y", ALL_GATHER, p, lin.calls, t, e, "dx GEMM"
            )
        t = st.links["y"].time(REDUCE_SCATTER, p)
        e = _max0(t - lin.gemm) if st.dx_overlap else t
        hid = "dW GEMM" if st.dx_overlap else ""
        rec.add(lin.name, "backward", "y", REDUCE_SCATTER, p, lin.calls, t, lin.calls * e, hid)
    else:
        p = st.m * lin.n / st.sizes[lin.out_axis] * st.c
        t = st.links["y"].time(ALL_GATHER, p)
        rec.add(lin.name, "backward", "y", ALL_GATHER, p, lin.calls, t, lin.calls * t)


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


def fine_all_reduce(
    rec: Recorder,
    st: Step,
    lin: PlacedLinear,
    phase: str,
    axis: str,
    p: float,
    chunks: int,
    ag_behind_dw: bool,
) -> None:
    """``fine`` (T3's layout): a reduce-scatter of ``p`` bytes fused with the GEMM that produces
    it, exposed ``fused - GEMM`` (:func:`tetrad.plan.comm.fine.ring_reduce_scatter_seconds`
    through :attr:`Step.fused_s <tetrad.plan.comm.record.Step>`: the ring's waits and the
    pieces' lower GEMM efficiency), then an all-gather of ``p`` bytes,
    exposed, or ``max(0, t - GEMM)`` when it runs during the dW GEMM (``ag_behind_dw``)."""
    link, calls = st.links[axis], lin.calls
    fused = st.fused_s(lin.flops, p, link, chunks)
    t_rs, t_ag = link.time(REDUCE_SCATTER, p), link.time(ALL_GATHER, p)
    e_ag = max(0.0, t_ag - lin.gemm) if ag_behind_dw else t_ag
    hid = f"its GEMM ({chunks} pieces per ring step)"
    rec.add(
        lin.name,
        phase,
        axis,
        REDUCE_SCATTER,
        p,
        calls,
        t_rs,
        calls * max(0.0, fused - lin.gemm),
        hid,
    )
    rec.add(
        lin.name,
        phase,
        axis,
        ALL_GATHER,
        p,
        calls,
        t_ag,
        calls * e_ag,
        "dW GEMM" if ag_behind_dw else "",
    )
