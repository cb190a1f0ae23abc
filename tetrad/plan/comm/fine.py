"""Time model of the fused GEMM + collective rings of :mod:`tetrad.comm.fused` (the ``fine``
overlap; T3, Pati et al., arXiv 2401.16677, in software).

A fused operator over a group of ``G`` ranks runs ``G`` ring steps of ``q`` row pieces each
(``q = chunks``). Per piece (every rank alike, so the piece a rank receives at step ``s`` left its
neighbour at step ``s - 1``):

    a = t_GEMM(F / (G q)) * (1 + slowdown)   compute of one piece: the GEMM's FLOPs ``F`` split in
                                             ``G q`` pieces, timed by the machine's GEMM table
                                             (smaller GEMMs run at a lower fraction of peak), slowed
                                             by the contention of the transfers running beside it
                                             (``[compute] overlap_slowdown``, measured by
                                             ``tetrad calibrate``)
    b = latency_base + (P / (G q)) / bandwidth   one point-to-point transfer of a piece of the
                                             payload ``P`` (every isend/irecv pays the per-call
                                             latency)

and the runtime's program order: one transfer at a time per rank, the compute stream in program
order, waits where the runtime waits. With ``q = 1`` the reduce-scatter is serial (each step's
``addmm`` folds in the neighbour's running sum, so it waits for it); pieces let a piece travel
while the next one computes.

The reduce-scatter's time has a closed form (:func:`reduce_scatter_ring_seconds`). Number the
``G q`` pieces ``k = s q + j`` in program order: compute ``C_k`` follows ``C_{k-1}`` and the
arrival of the piece's running sum ``T_{k-q}``; transfer ``T_k`` (``k < (G-1) q``) follows
``C_k`` and ``T_{k-1}``. The ring ends with the last compute, the longest path through this
graph, node ``C`` weighing ``a`` and node ``T`` weighing ``b``. A path that makes ``r`` round
trips ``C -> T -> C`` (each jumping ``q`` pieces ahead) and visits ``t`` transfers weighs ``a
(G q - r q + 2 r - t) + b t`` with ``1 <= r <= G - 1`` and ``r <= t <= (G - r) q + r - 1``
(``r = 0``: every compute, ``a G q``); both bounds are reached, and the weight is linear in
``(r, t)`` over that polygon, so the longest path is at one of its corners:

    T_RS = max(a G q,                      r = 0
               a (G q - q + 1) + b,        r = 1,     t = 1
               a (q + G - 1) + b (G - 1),  r = G - 1, t = G - 1
               2 a + b (G - 1) q,          r = 1,     t = (G - 1) q
               a G + b (q + G - 2))        r = G - 1, t = q + G - 2

(``q = 1``: ``a G + b (G - 1)``, serial.) :func:`replay_reduce_scatter` replays the runtime's
events one by one, the oracle the closed form is tested against
(tests/test_plan_fine.py). The all-gather -> GEMM ring is replayed
(:func:`ring_all_gather_seconds`; the search does not use it).

Ideal overlap (T3's bound): ``max(t_GEMM, t_collective)``.
"""

from __future__ import annotations

from collections.abc import Callable

from tetrad.plan.machine.network import REDUCE_SCATTER, Link

CHUNK_CANDIDATES = (1, 2, 4, 8)
"""Pieces per ring step the planner chooses from."""


def _piece_times(
    gemm_s: Callable[[float], float],
    flops: float,
    payload: float,
    link: Link,
    chunks: int,
    slowdown: float,
) -> tuple[float, float]:
    n = link.size * chunks
    a = gemm_s(flops / n) * (1.0 + slowdown)
    b = link.base_latency + payload / n / link.bandwidth
    return a, b


def reduce_scatter_ring_seconds(a: float, b: float, g: int, q: int) -> float:
    """Seconds of the fused GEMM -> reduce-scatter ring in closed form (module doc): ``g >= 2``
    ring steps of ``q`` pieces, ``a`` seconds to compute a piece, ``b`` to send one."""
    return max(
        a * g * q,
        a * (g * q - q + 1) + b,
        a * (q + g - 1) + b * (g - 1),
        2.0 * a + b * (g - 1) * q,
        a * g + b * (q + g - 2),
    )


def replay_reduce_scatter(a: float, b: float, g: int, q: int) -> float:
    """The same ring replayed event by event in the runtime's program order (the oracle of
    :func:`reduce_scatter_ring_seconds`): one transfer at a time, the compute stream in order,
    a piece's step waiting for its running sum from the neighbour, its rows reused only after
    the previous step's send."""
    cpu = link_free = 0.0
    arrive = [0.0] * q  # when piece j of the previous step arrived from the neighbour
    sent = [0.0] * q  # when piece j's send of the previous step finished
    for s in range(g):
        for j in range(q):
            start = max(cpu, arrive[j]) if s else cpu
            cpu = start + a
            if s < g - 1:
                link_free = max(cpu, link_free) + b
                if s:  # its buffer rows are reused only after the previous step's send
                    cpu = max(cpu, sent[j])
                sent[j] = arrive[j] = link_free
    return cpu


def ring_reduce_scatter_seconds(
    gemm_s: Callable[[float], float],
    flops: float,
    payload: float,
    link: Link,
    chunks: int = 1,
    slowdown: float = 0.0,
) -> float:
    """Seconds of :func:`tetrad.comm.fused.ring_matmul_reduce_scatter` (GEMM -> reduce-scatter),
    :func:`reduce_scatter_ring_seconds` of the pieces' times (module doc).

    Args:
        gemm_s: seconds of one GEMM of the given FLOPs on this machine.
        flops: FLOPs of the whole GEMM ``2 (G m) n k``; payload: its output bytes ``G m n c``.
        link: the group's :class:`~tetrad.plan.machine.network.Link` (``G = link.size``).
        chunks: pieces per ring step ``q``; slowdown: compute contention factor.
    """
    g = link.size
    if g <= 1:
        return gemm_s(flops)
    a, b = _piece_times(gemm_s, flops, payload, link, chunks, slowdown)
    return reduce_scatter_ring_seconds(a, b, g, chunks)


def ring_all_gather_seconds(
    gemm_s: Callable[[float], float],
    flops: float,
    payload: float,
    link: Link,
    chunks: int = 1,
    slowdown: float = 0.0,
) -> float:
    """Seconds of :func:`tetrad.comm.fused.ring_all_gather_matmul` (all-gather -> GEMM); the
    arguments as :func:`ring_reduce_scatter_seconds`, ``payload`` the gathered input's bytes."""
    g = link.size
    if g <= 1:
        return gemm_s(flops)
    a, b = _piece_times(gemm_s, flops, payload, link, chunks, slowdown)
    cpu = link_free = 0.0
    arrive = [0.0] * chunks
    for s in range(g):
        for j in range(chunks):
            t = max(cpu, arrive[j]) if s else cpu
            if s < g - 1:  # forward the piece in hand, then multiply it
                link_free = max(t, link_free) + b
                arrive[j] = link_free
            cpu = t + a
    return max(cpu, link_free)


def best_chunks(
    gemm_s: Callable[[float], float],
    flops: float,
    payload: float,
    link: Link,
    slowdown: float = 0.0,
    candidates: tuple[int, ...] = CHUNK_CANDIDATES,
) -> tuple[int, float]:
    """``(chunks, seconds)`` of the fastest GEMM -> reduce-scatter among ``candidates``."""
    got = [
        (ring_reduce_scatter_seconds(gemm_s, flops, payload, link, q, slowdown), q)
        for q in candidates
    ]
    t, q = min(got)
    return q, t


def sublayer_seconds(
    gemm_s: Callable[[float], float],
    flops: float,
    payload: float,
    link: Link,
    chunks: int,
    slowdown: float = 0.0,
) -> dict[str, float]:
    """T3's sublayer view of one GEMM -> reduce-scatter: ``gemm``, ``collective`` (a ring
    reduce-scatter of ``payload`` bytes), ``sequential`` (their sum), ``fused`` and ``ideal``
    (``max(gemm, collective)``), seconds."""
    gemm, coll = gemm_s(flops), link.time(REDUCE_SCATTER, payload)
    fused = ring_reduce_scatter_seconds(gemm_s, flops, payload, link, chunks, slowdown)
    return {
        "gemm": gemm,
        "collective": coll,
        "sequential": gemm + coll,
        "fused": fused,
        "ideal": max(gemm, coll),
    }
