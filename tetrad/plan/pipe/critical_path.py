"""The step of a pipeline schedule from each stage's forward and backward seconds per micro-batch:
the critical path (the longest chain of computations and receives) of the order in which
``torch.distributed.pipelining``'s ScheduleGPipe, Schedule1F1B and ScheduleInterleaved1F1B run the
micro-batches on each rank (torch 2.13, :func:`rank_actions`). Plain Python.

Notation: ``p`` pipeline ranks, ``v`` stages per rank (``p v`` stages, stage ``s`` on rank
``s mod p``, the "loop" placement), ``m`` micro-batches per step; ``f_s`` and ``b_s`` the
seconds stage ``s`` takes for one micro-batch's forward (the last stage's with the LM head and
loss) and backward (with its recomputation), each with the receive of its input (the planner
counts a rank's point-to-point receives on its critical path); ``T_r`` the sum of both over the
``v`` stages of rank ``r``.

The graph: a rank runs its operations one at a time in its schedule's order; the forward of
micro-batch ``j`` on stage ``s`` starts after that on stage ``s - 1``, its backward after the
backward on stage ``s + 1`` (on the last stage, after its own forward). The step is the end of
the last operation, the longest path of this graph: the pipeline flush of Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", arXiv
2104.04473 (SC 2021), section 2.2, with a time per stage instead of one for all. On equal stages
(``f_s = t_F / v``, ``b_s = t_B / v``) it is that section's ``(m + (p - 1) / v) (t_F + t_B)``:
bubble ``(p - 1)(t_F + t_B)`` for GPipe (Huang et al., arXiv 1811.06965) and 1F1B, ``1 / v`` of
it interleaved (tested). On unequal stages the bubble is what the other ranks' work leaves
idle on the slowest, less or more than ``(p - 1) max_r T_r``.

:func:`schedule_step` is the planner's step: GPipe in closed form (exact: each phase is a flow
shop of identical micro-batches); 1F1B and interleaved 1F1B simulated (:func:`simulate_step`),
exactly up to :data:`EXACT_ROUNDS` ``p`` micro-batches; beyond, the step grows by a constant
pace per micro-batch once the start-up has settled (in max-plus terms, the recurrence's cycle
time: Baccelli et al., "Synchronization and Linearity", 1992, chapter 3; ``max_r T_r`` for
1F1B, whose other cycles average some ranks' ``T_r``; more for interleaved 1F1B on unequal
stages, whose rounds of ``p`` micro-batches pace through each stage in turn): the step of the
first ``m'`` micro-batches plus that pace per further one, where its last round of ``p``
grew by ``max_r T_r`` per micro-batch, or its last two by the same pace above it. Where the
growth per round takes ``c > 1`` values in turn (the recurrence's cyclicity ``c``, same
chapter: past a transient, ``c`` more steps add ``c`` cycle times; interleaved 1F1B on
unequal stages, e.g. gpt-80b's 42 blocks on ``p = 16, v = 2``), the step of the first ``e``
plus, per further ``c p`` micro-batches, what each of its last two periods of ``c p`` grew by
(``e`` is ``m'`` or up to ``c p - 1`` more, so that ``c p`` divides ``m - e``; ``c`` in
:data:`CYCLICITIES`). ``m'`` doubles from ``EXACT_ROUNDS p`` until one holds, else all ``m``
are simulated. Every length simulated is a graph of its own: the order of ``m`` micro-batches
is no prefix of a longer one's (its last backwards run where the longer one interleaves more
forwards; interleaved, ``m`` also sets the rounds ``q`` and the warm-up). Tested equal to the
full simulation on the runtime's splits, perturbed ones and gpt-80b's.

Never below it: ``m max_r T_r`` (the slowest rank's operations one after another), and for any
rank ``r`` its ``m T_r`` plus micro-batch 0's forward through stages ``0 .. r - 1`` before its
first operation and the last micro-batch's backward through them after its last (each rank
starts with its first stage's first forward and ends with that stage's last backward): the
search's bounds (:mod:`tetrad.plan.search.pipeline.floor_terms`).
"""

from __future__ import annotations

from collections.abc import Sequence

EXACT_ROUNDS = 2
"""1F1B and interleaved 1F1B are simulated over this many times ``p`` micro-batches first (the
count doubling until their pace settles, at most ``m``)."""

CYCLICITIES = (2, 3, 4)
"""Periods, in rounds of ``p`` micro-batches, that :func:`_periodic` looks for where the
growth per round does not settle to one pace (its cyclicity ``c``, module doc)."""

_GRAPHS: dict = {}


def rank_actions(schedule: str, pipe: int, virtual: int, micro_batches: int, rank: int) -> list:
    """``(kind, stage, micro-batch)`` in the order pipeline rank ``rank`` runs them, ``kind`` 0
    for a forward and 1 for a backward: GPipe all forwards then all backwards; 1F1B ``min(m, p -
    r)`` forwards, then a backward and a forward in turn (torch's ``Schedule1F1B``); interleaved,
    torch's ``ScheduleInterleaved1F1B._calculate_single_rank_operations`` (``_get_1f1b_rank_ops``
    without its idle slots): ``w = min((v - 1) q + 2 (p - r - 1), m v)`` warm-up forwards (``q``
    micro-batches per round, ``p`` when ``p`` divides ``m``), then a forward and a backward in
    turn, then the last backwards; forward number ``k`` runs local stage ``(k // q) mod v``,
    backward number ``k`` local stage ``v - 1 - (k // q) mod v``."""
    p, v, m, r = pipe, virtual, micro_batches, rank
    if schedule == "gpipe":
        return [(0, r, j) for j in range(m)] + [(1, r, j) for j in range(m)]
    if schedule == "1f1b":
        w = min(m, p - r)
        out = [(0, r, j) for j in range(w)]
        for j in range(m):
            out.append((1, r, j))
            if j + w < m:
                out.append((0, r, j + w))
        return out
    q = m // max(1, m // p)
    warm = min((v - 1) * q + 2 * (p - 1 - r), m * v)
    fwd_done, bwd_done = [0] * v, [0] * v
    out = []
    append = out.append
    for k in range(m * v):
        local = (k // q) % v
        append((0, local * p + r, fwd_done[local]))
        fwd_done[local] += 1
        if k >= warm:
            local = v - 1 - ((k - warm) // q) % v
            append((1, local * p + r, bwd_done[local]))
            bwd_done[local] += 1
    for k in range(m * v - warm, m * v):
        local = v - 1 - (k // q) % v
        append((1, local * p + r, bwd_done[local]))
        bwd_done[local] += 1
    return out


def _graph(schedule: str, pipe: int, virtual: int, micro_batches: int) -> tuple:
    """The schedule's operations in an order that runs each after what it waits for:
    ``(prev, dep, key)`` per operation, the indices of the rank's previous operation and of the
    one it receives from (``n``, a slot holding 0.0, for none) and ``2 s + kind`` (memoised)."""
    key = (schedule, pipe, virtual, micro_batches)
    got = _GRAPHS.get(key)
    if got is not None:
        return got
    n_st, m = pipe * virtual, micro_batches
    total = 2 * n_st * m  # operation (kind, s, j) is number (kind n_st + s) m + j
    ranks = [_rank_ops(rank_actions(schedule, pipe, virtual, m, r), n_st, m) for r in range(pipe)]
    pos = [-1] * total + [total]  # where each operation is in the order; the last: none
    prev, dep, keys = [], [], []
    add_prev, add_dep, add_key = prev.append, dep.append, keys.append
    at, last = [0] * pipe, [total] * pipe
    n = 0  # operations placed
    while n < total:
        moved = False
        for r in range(pipe):
            rid, rsrc, rkey = ranks[r]
            start = i = at[r]
            here, size = last[r], len(rid)
            while i < size:
                got = pos[rsrc[i]]
                if got < 0:
                    break
                pos[rid[i]] = n
                add_prev(here)
                add_dep(got)
                add_key(rkey[i])
                here = n
                n += 1
                i += 1
            if i != start:
                moved = True
                at[r], last[r] = i, here
        if not moved:
            raise RuntimeError(f"{schedule} p={pipe} v={virtual} m={m}: the order deadlocks")
    got = tuple(zip(prev, dep, keys, strict=True))
    if len(_GRAPHS) > 256:
        _GRAPHS.clear()
    _GRAPHS[key] = got
    return got


def _rank_ops(order: list, n_st: int, m: int) -> tuple[list, list, list]:
    """``(ids, sources, keys)`` of a rank's operations ``order`` (:func:`rank_actions`): each
    one's number, that of the one it receives from (a forward from the previous stage's
    forward, a backward from the next stage's backward, the last stage's from its own forward;
    ``2 n_st m``, a slot holding 0.0, for none) and ``2 s + kind``."""
    none = 2 * n_st * m
    ids, srcs, keys = [], [], []
    for kind, s, j in order:
        ids.append((kind * n_st + s) * m + j)
        if kind == 0:
            srcs.append((s - 1) * m + j if s > 0 else none)
        else:
            srcs.append((n_st + s + 1) * m + j if s < n_st - 1 else s * m + j)
        keys.append(2 * s + kind)
    return ids, srcs, keys


def simulate_step(
    schedule: str,
    pipe: int,
    virtual: int,
    micro_batches: int,
    fwd: Sequence[float],
    bwd: Sequence[float],
) -> float:
    """The step, seconds: the end of the last operation when each starts as soon as its rank's
    previous one and its input are done (module doc); ``fwd[s]``, ``bwd[s]`` per stage ``s`` of
    the ``p v``. Exact; ``O(p v m)`` steps (the order is memoised per shape)."""
    dur = [0.0] * (2 * len(fwd))
    dur[0::2], dur[1::2] = list(fwd), list(bwd)
    graph = _graph(schedule, pipe, virtual, micro_batches)
    end = [0.0] * (len(graph) + 1)
    i = 0
    for a, b, k in graph:
        x, y = end[a], end[b]
        end[i] = (x if x > y else y) + dur[k]
        i += 1
    return max(end)


def rank_seconds(pipe: int, fwd: Sequence[float], bwd: Sequence[float]) -> list[float]:
    """``T_r``: each rank's forward and backward seconds of one micro-batch, all its stages."""
    out = [0.0] * pipe
    for s, (f, b) in enumerate(zip(fwd, bwd, strict=True)):
        out[s % pipe] += f + b
    return out


def schedule_step(
    schedule: str,
    pipe: int,
    virtual: int,
    micro_batches: int,
    fwd: Sequence[float],
    bwd: Sequence[float],
) -> float:
    """The planner's step of the schedule, seconds (module doc): GPipe ``sum_s f_s + (m - 1)
    max_s f_s + sum_s b_s + (m - 1) max_s b_s``; 1F1B and interleaved 1F1B
    :func:`simulate_step` on ``m' = EXACT_ROUNDS p`` micro-batches (all ``m`` where not more)
    plus ``m - m'`` times its pace, once settled (:func:`_settled`), or plus whole periods of
    ``c p`` micro-batches once periodic (:func:`_periodic`); else ``m'`` doubles."""
    m = micro_batches
    if schedule == "gpipe":
        return sum(fwd) + sum(bwd) + (m - 1) * (max(fwd) + max(bwd))
    t_max = max(rank_seconds(pipe, fwd, bwd))
    seen: dict[int, float] = {}

    def step(k: int) -> float:
        got = seen.get(k)
        if got is None:
            got = seen[k] = simulate_step(schedule, pipe, virtual, k, fwd, bwd)
        return got

    periodic = schedule == "1f1b" or m % pipe == 0
    short = EXACT_ROUNDS * pipe
    while short < m:
        got = _settled(step, pipe, short, t_max)
        if got is not None:
            return got[0] + (m - short) * got[1]
        got = _periodic(step, pipe, short, m, t_max) if periodic else None
        if got is not None:
            return got
        short *= 2
    return step(m)


def _settled(step, pipe: int, short: int, t_max: float) -> tuple[float, float] | None:
    """``(step of short micro-batches, pace)`` where the step grew by ``t_max`` per
    micro-batch (a rank's own work) over its last ``p``, or by one pace above it over each of
    the last two rounds of ``p``; else None (a start-up still settling). ``step(k)``: the
    step of ``k`` micro-batches."""
    a, b = step(short), step(short - pipe)
    pace, tol = (a - b) / pipe, 1e-9 * t_max
    if abs(pace - t_max) <= tol:
        return a, t_max
    if pace > t_max and abs((b - step(short - 2 * pipe)) / pipe - pace) <= tol:
        return a, pace
    return None


def _periodic(step, pipe: int, short: int, m: int, t_max: float) -> float | None:
    """The step of ``m`` micro-batches where that of ``e`` (the least from ``short`` and from
    ``2 c p + p`` with ``m - e`` a multiple of ``c p``, at most ``2 short``) grew by one amount
    over each of its last two periods
    of ``c p`` micro-batches (``c`` in :data:`CYCLICITIES`; at least ``c p t_max``, to
    ``1e-9 t_max`` per micro-batch): ``step(e)`` plus that amount per further period (the
    recurrence's cyclicity, module doc); else None. The interleaved order depends on ``m``
    through its rounds, so the caller passes only ``m`` that ``p`` divides (then so does
    ``e``) for it."""
    tol = 1e-9 * t_max
    for c in CYCLICITIES:
        period = c * pipe
        start = max(short, 2 * period + pipe)  # two whole periods after the first round
        end = start + (m - start) % period
        if end > min(m, 2 * short):
            continue  # not before the next doubling would simulate as much
        a, b = step(end), step(end - period)
        grew = a - b
        if grew / period < t_max - tol or abs((b - step(end - 2 * period) - grew) / period) > tol:
            continue
        return a + (m - end) // period * grew
    return None
