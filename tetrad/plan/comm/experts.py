"""Expert parallelism's all-to-all traffic per MoE block and micro-batch: exact for given
routing counts (what :class:`tetrad.parallel.experts.ExpertParallelExperts` sends), and a
uniform-routing estimate with an imbalance factor. Plain Python.

The runtime, per MoE block and micro-batch, on each rank of an expert group of ``P`` ranks
(``E`` experts, ``E/P`` per rank, rows of ``h`` elements of ``b`` bytes):

    forward    counts   all-to-all of ``E`` int64 counts, ``E/P`` to each rank
               dispatch ``T k`` rows out (``out_j`` to rank ``j``), ``R`` rows in
               combine  the ``R`` rows back, the ``T k`` rows home
    backward   the two row all-to-alls again, each the other way (their autograd)
    recompute  (full activation checkpointing) the three forward calls once more

With the ``expert`` overlap the ``T`` tokens are cut into ``n`` pieces
(:func:`tetrad.spec.overlap.piece_sizes`): one counts all-to-all of ``n E`` counts, and a
dispatch and a combine per piece (and their two backward calls), each of its own rows.

Per call the runtime records (:mod:`tetrad.comm.all_to_all`) the payload, the larger of
input and output (``max(T k, R) h b`` for a row all-to-all), and the bytes sent to the other
ranks (``(T k - out_self) h b`` for a dispatch, ``(R - in_self) h b`` for a combine). Under
uniform routing each rank sends ``V = T k h b (P - 1)/P`` per row all-to-all (the fact sheet's
formula: /work/shared/notes/moe-expert-parallelism.md section 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tetrad.plan.machine.network import GB, Network, placement
from tetrad.spec.overlap import piece_sizes

COUNT_BYTES = 8
"""Bytes of one routing count (int64, as ``torch.bincount`` gives)."""


@dataclass(frozen=True)
class AllToAllTraffic:
    """One rank's expert-parallel all-to-alls for one MoE block and micro-batch.

    Attributes:
        calls: all-to-alls issued (forward and backward).
        payload_bytes: the sum over calls of the larger of input and output, bytes.
        sent_bytes: bytes sent to the other ranks of the expert group.
    """

    calls: int
    payload_bytes: float
    sent_bytes: float


def all_to_all_traffic(
    pieces: Sequence[Sequence[Sequence[int]]],
    rank: int,
    hidden: int,
    elem_bytes: int,
    backward: bool = True,
    recompute: bool = False,
) -> AllToAllTraffic:
    """The exact all-to-all traffic of rank ``rank`` of an expert group of ``P`` ranks.

    Args:
        pieces: ``[n][P][E]``, per piece of the tokens (``n`` of the ``expert`` overlap, 1
            without it): ``pieces[i][s][e]`` = token slots of rank ``s``'s piece ``i`` routed
            to expert ``e`` (global index; rank ``j`` holds experts ``[j E/P, (j+1) E/P)``).
        rank: the rank whose traffic to return (its place in the expert group).
        hidden: ``h``, elements per token row.
        elem_bytes: ``b``, bytes per element of the rows (the compute dtype's).
        backward: include the backward's row all-to-alls.
        recompute: include the forward's calls once more (full recomputation).

    Raises:
        ValueError: ``E`` not divisible by ``P``, or ragged counts.
    """
    p, e = len(pieces[0]), len(pieces[0][0])
    if e % p or any(len(c) != e for counts in pieces for c in counts):
        raise ValueError(f"counts must be [n][P][E] with E divisible by P (got {p} x {e})")
    n = e // p
    row = hidden * elem_bytes
    rows_calls = []
    for counts in pieces:
        to_rank = [[sum(c[j * n : (j + 1) * n]) for j in range(p)] for c in counts]  # [src][dst]
        out_rows = sum(to_rank[rank])
        in_rows = sum(to_rank[s][rank] for s in range(p))
        own = to_rank[rank][rank]
        payload = max(out_rows, in_rows) * row
        rows_calls += [(payload, (out_rows - own) * row), (payload, (in_rows - own) * row)]
    return _traffic(len(pieces), e, n, rows_calls, backward, recompute)


def _traffic(
    pieces: int, e: int, local: int, rows_calls: list, backward: bool, recompute: bool
) -> AllToAllTraffic:
    """The calls of a block: the counts' (``pieces E`` int64), the rows' (``rows_calls``:
    ``(payload, sent)`` of every piece's dispatch and combine), the rows' again in backward."""
    counts_call = (pieces * e * COUNT_BYTES, pieces * (e - local) * COUNT_BYTES)
    forward = [counts_call, *rows_calls]
    calls = forward + (rows_calls if backward else []) + (forward if recompute else [])
    return AllToAllTraffic(
        len(calls), float(sum(c[0] for c in calls)), float(sum(c[1] for c in calls))
    )


def uniform_all_to_all_traffic(
    tokens: int,
    top_k: int,
    n_experts: int,
    expert_parallel: int,
    hidden: int,
    elem_bytes: int,
    imbalance: float = 1.0,
    backward: bool = True,
    recompute: bool = False,
    pieces: int = 1,
) -> AllToAllTraffic:
    """The all-to-all traffic of the busiest rank when every rank's ``T = tokens`` tokens
    choose their ``k = top_k`` experts uniformly, except that the busiest rank's experts
    receive ``imbalance`` times the mean number of rows, ``T k imbalance`` (``imbalance`` >= 1;
    its own tokens spread evenly: ``T k / P`` of them stay on the rank), the tokens in
    ``pieces`` pieces (the ``expert`` overlap's). Equal to :func:`all_to_all_traffic` for
    perfectly balanced counts with ``imbalance = 1``.

    Raises:
        ValueError: ``imbalance < 1`` or ``n_experts`` not divisible by ``expert_parallel``.
    """
    p = expert_parallel
    if imbalance < 1 or n_experts % p:
        raise ValueError("imbalance must be >= 1 and n_experts divisible by expert_parallel")
    row = hidden * elem_bytes
    rows_calls = []
    for size in piece_sizes(tokens, pieces):
        slots = size * top_k
        own, in_rows = slots / p, slots * imbalance
        payload = max(slots, in_rows) * row
        rows_calls += [(payload, (slots - own) * row), (payload, (in_rows - own) * row)]
    return _traffic(pieces, n_experts, n_experts // p, rows_calls, backward, recompute)


def pipelined_seconds(first: list[float], compute: list[float], after: list[float]) -> float:
    """The span of the ``expert`` overlap's pieces in the order they are processed: every
    piece's ``first`` exchange (forward: the dispatches; backward: the combines' gradients)
    issued at once, one at a time on the communicator; piece ``i``'s ``compute`` once its own
    has arrived and piece ``i-1``'s compute is done; its ``after`` exchange (forward: the
    combine; backward: the dispatch's gradient) issued when its compute ends, behind what the
    communicator is already running. Seconds until the last of them ends; with one piece
    ``first + compute + after``."""
    link = 0.0  # when the communicator is free
    arrived = []
    for t in first:
        link += t
        arrived.append(link)
    done = 0.0  # when the compute stream is free
    for got, c, a in zip(arrived, compute, after, strict=True):
        done = max(done, got) + c
        link = max(link, done) + a
    return max(link, done)


@dataclass(frozen=True)
class AxisTraffic:
    """One rank's collectives on one grid axis (as :class:`tetrad.comm.CommLog` records them).

    Attributes:
        calls: collectives issued.
        payload_bytes: the sum over calls of the larger of input and output, bytes.
        sent_bytes: ring bytes sent (all-gather ``(G-1)/G`` of the output, all-reduce
            ``2(G-1)/G`` of the buffer).
    """

    calls: int
    payload_bytes: float
    sent_bytes: float


def tensor_token_traffic(
    tokens: int,
    hidden: int,
    elem_bytes: int,
    g_y: int,
    g_x: int,
    stats: tuple[int, int] | None = None,
    backward: bool = True,
    recompute: bool = False,
) -> dict[str, AxisTraffic]:
    """The X and Y collectives of one MoE block and micro-batch on a tensor grid
    (:mod:`tetrad.parallel.moe_tensor`: each of the ``n = G_y G_x`` tensor ranks routes
    ``T/n`` of the rank's ``T = tokens`` tokens whole), keyed ``"x"`` and ``"y"`` (roles).

    Forward: the split's all-to-all over X (``T h b / n`` bytes in and out, ``(G_x-1)/G_x`` of
    it sent); the join's all-to-all over X (the same) and all-gather over Y (output
    ``T h b / G_x``). Backward: the join's backward is a split and the split's a join.
    ``stats = (slot_bytes, aux_bytes)`` adds the load-balancing term's all-reduces (when
    ``aux_loss_coef > 0``): the slot counts (``[groups, E]``, ``slot_bytes`` in all) and the
    0-dim term (``aux_bytes``), each over Y then X. Full recomputation runs the forward once
    more. Not included: the selection-bias counts' all-reduce over Y and X, once per step.

    Raises:
        ValueError: ``tokens`` not divisible by ``G_y G_x``.
    """
    n = g_y * g_x
    if tokens % n:
        raise ValueError(f"tokens={tokens} must be divisible by G_y*G_x={n}")
    slice_bytes = tokens * hidden * elem_bytes / n

    def once(g: int, payload: float, sent_share: float) -> list[tuple[float, float]]:
        return [(payload, sent_share * payload)] if g > 1 else []

    exchange = once(g_x, slice_bytes, (g_x - 1) / g_x)  # all-to-all over X
    split = {"x": exchange, "y": []}
    join = {"x": exchange, "y": once(g_y, g_y * slice_bytes, (g_y - 1) / g_y)}
    out = {}
    for axis, g in (("x", g_x), ("y", g_y)):
        forward = split[axis] + join[axis]
        if stats is not None:
            forward += once(g, stats[0], 2 * (g - 1) / g) + once(g, stats[1], 2 * (g - 1) / g)
        calls = forward + (split[axis] + join[axis] if backward else [])
        calls += forward if recompute else []
        out[axis] = AxisTraffic(
            len(calls), float(sum(c[0] for c in calls)), float(sum(c[1] for c in calls))
        )
    return out


def all_to_all_seconds(network: Network, stride: int, size: int, sent_bytes: float) -> float:
    """Seconds of one all-to-all over the group ``{base + i * stride : i < size}`` (an expert
    group: ``G_expert`` consecutive ranks of a pipeline stage, stride 1) in which the busiest
    rank sends (or receives) ``sent_bytes`` to (from) the other members, split evenly between
    them: NCCL's grouped point-to-point all-to-all, each rank exchanging with every peer at once.

    On the network hierarchy of :mod:`tetrad.plan.machine.network`: of the ``size - 1`` peers,
    ``q - 1`` share the rank's node (``q`` members per node, :func:`~tetrad.plan.machine.
    network.placement`) and are reached over the in-node fabric (``intra_node_gbps``), the other
    ``size - q`` through the rank's own share of the node's NICs (``inter_node_gbps_per_member``:
    every rank of the node runs its own group's all-to-all at the same time); the two run
    concurrently, so the transfer is the slower of the two, plus NCCL's base latency and one
    step's latency per peer (the per-peer setup of Hockney's alpha-beta model: Thakur,
    Rabenseifner and Gropp, IJHPCA 2005, section 4, pairwise exchange). 0 for one rank.
    """
    if size <= 1:
        return 0.0
    q, nodes = placement(stride, size, network.gpus_per_node)
    per_peer = sent_bytes / (size - 1)
    intra = (q - 1) * per_peer / (network.intra_node_gbps * GB)
    inter = (size - q) * per_peer / (network.inter_node_gbps_per_member * GB) if nodes > 1 else 0.0
    hop = network.latency_hop_intra_us if nodes == 1 else network.latency_hop_inter_us
    return network.latency_base_us * 1e-6 + (size - 1) * hop * 1e-6 + max(intra, inter)
