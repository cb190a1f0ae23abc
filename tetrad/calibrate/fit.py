"""The fits of ``tetrad calibrate``: the GEMM efficiency table and the network model.

Per group layout the alpha-beta ring model of :mod:`tetrad.plan.machine.network` is fitted to the
collective times by weighted least squares (relative error, coefficients kept non-negative)::

    t = alpha_kind + ring_bytes / bandwidth
    ring_bytes = 2 (G-1)/G * payload (all-reduce),  (G-1)/G * output (all-gather)

one bus bandwidth per layout and one ``alpha`` per kind. The ``alpha`` values are then fitted
to ``latency_base + hops * latency_hop`` with the planner's hop counts
(:func:`tetrad.plan.machine.network.ring_hops`: all-reduce ``min(2 (G-1), 2 ceil(log2 G))``,
all-gather ``G-1``).

Groups inside one node (ranks ``0 .. LOCAL_WORLD_SIZE-1`` share a node) give the in-node
bandwidths and the in-node hop latency; groups spanning nodes give the bandwidth per member on a
node (the worst layout) and the inter-node hop latency. On a single node nothing crosses nodes:
the bandwidth per member is set to the worst measured in-node bandwidth and the inter-node hop
latency to the in-node one (:func:`fit_network`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from tetrad.calibrate.settings import KINDS, layouts
from tetrad.plan.machine.network import placement, ring_hops


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (keeps the TOML readable)."""
    return float(f"{x:.{digits}g}")


def efficiency_table(gemms: list[dict], peak: float) -> list[list[float]]:
    """``[[flops, fraction], ...]`` ascending: per half decade of GEMM FLOPs, the median
    fraction of ``peak`` (clamped to ``[0.001, 1]``) at the geometric mean of its FLOPs."""
    buckets: dict[float, list[dict]] = {}
    for g in gemms:
        buckets.setdefault(round(2.0 * math.log10(g["flops"])) / 2.0, []).append(g)
    table = []
    for key in sorted(buckets):
        rows = buckets[key]
        f = 10 ** statistics.fmean(math.log10(r["flops"]) for r in rows)
        e = statistics.median(r["flops_per_s"] for r in rows) / peak
        table.append([sig(f), round(min(1.0, max(0.001, e)), 3)])
    return table


def _nnls(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least squares ``rows @ x ~ target`` with ``x >= 0`` (drop the most negative coefficient
    and solve again until none is negative)."""
    ncol = len(rows[0])
    active = list(range(ncol))
    x = [0.0] * ncol
    while active:
        a = torch.tensor([[r[j] for j in active] for r in rows], dtype=torch.float64)
        b = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
        sol = torch.linalg.lstsq(a, b, driver="gelsd").solution.squeeze(1).tolist()
        worst = min(range(len(active)), key=lambda i: sol[i])
        if sol[worst] >= 0.0:
            for i, j in enumerate(active):
                x[j] = sol[i]
            return x
        active.pop(worst)
    return x


RESOLVED = 0.1
"""The least share of the largest measurement's time the bandwidth term must explain for the
fitted bandwidth to be used (:func:`fit_alpha_beta`)."""


def fit_alpha_beta(points: list[dict]) -> tuple[dict[str, float], float]:
    """Fit ``seconds = alpha[kind] + ring_bytes / bandwidth`` to measurements of one layout
    (dicts as from :func:`tetrad.calibrate.measure.measure_collectives`), minimising relative
    error, coefficients non-negative. Returns ``({kind: alpha seconds}, bandwidth bytes/s)``;
    when the times do not grow with the bytes, or the fitted bandwidth term is under
    :data:`RESOLVED` of the largest measurement's time (the sizes measured cannot resolve it:
    latency and noise dominate), the bandwidth is the best ``ring_bytes / seconds`` seen (a
    lower bound, so the planner errs on the slow side)."""
    kinds = sorted({p["kind"] for p in points})
    rows, target = [], []
    for p in points:
        t = p["seconds"]
        rows.append([(1.0 if p["kind"] == k else 0.0) / t for k in kinds] + [p["ring_bytes"] / t])
        target.append(1.0)
    x = _nnls(rows, target)
    inv_bw = x[-1]
    big = max(points, key=lambda p: p["ring_bytes"])
    if big["ring_bytes"] * inv_bw < RESOLVED * big["seconds"]:
        bw = max(p["ring_bytes"] / p["seconds"] for p in points)
    else:
        bw = 1.0 / inv_bw
    return dict(zip(kinds, x[:-1], strict=True)), bw


def fit_latency(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Fit ``alpha = base + hops * hop`` to ``(hops, alpha seconds)`` pairs, both ``>= 0``.
    Returns ``(base, hop)`` seconds; ``(0, 0)`` without points."""
    if not points:
        return 0.0, 0.0
    base, hop = _nnls([[1.0, float(h)] for h, _ in points], [a for _, a in points])
    return base, hop


def fit_hop(points: list[tuple[int, float]]) -> float:
    """Fit ``alpha = hops * hop`` (no intercept) to ``(hops, alpha seconds)`` pairs by least
    squares; returns ``hop`` seconds, ``>= 0``."""
    num = sum(h * a for h, a in points)
    return max(0.0, num / sum(h * h for h, _ in points))


# ---- the network -----------------------------------------------------------------------------


@dataclass(frozen=True)
class NetworkFit:
    """The network figures fitted from the collective measurements (:func:`fit_network`).

    Attributes:
        layouts: per group layout a dict with ``stride, members, members_per_node, nodes``,
            ``gbps`` (bus bandwidth, GB/s) and ``alpha_<kind>_us`` (microseconds per call).
        intra: the layouts inside one node; ``inter``: those spanning nodes.
        whole: the stride-1 layout of a whole node (or the world when smaller), if measured.
        intra_gbps: in-node bus bandwidth, GB/s.
        inter_gbps_per_member: bandwidth per member on a node of a group spanning nodes, GB/s
            (single node: the worst in-node bandwidth).
        base: per-call latency, seconds.
        hop_intra: per ring step inside a node, seconds.
        hop_inter: per ring step across nodes, seconds (single node: ``hop_intra``).
    """

    layouts: list[dict]
    intra: list[dict]
    inter: list[dict]
    whole: dict | None
    intra_gbps: float
    inter_gbps_per_member: float
    base: float
    hop_intra: float
    hop_inter: float


def fit_layouts(colls: list[dict], world: int, ranks_per_node: int) -> list[dict]:
    """:func:`fit_alpha_beta` per layout of :func:`~tetrad.calibrate.settings.layouts`, with
    its placement on nodes of ``ranks_per_node`` ranks (the ``layouts`` of
    :class:`NetworkFit`)."""
    fits = []
    for stride, size in layouts(world):
        pts = [c for c in colls if c["stride"] == stride and c["members"] == size]
        alphas, bw = fit_alpha_beta(pts)
        q, nodes = placement(stride, size, ranks_per_node)
        fits.append(
            {
                "stride": stride,
                "members": size,
                "members_per_node": q,
                "nodes": nodes,
                "gbps": sig(bw / 1e9),
                **{f"alpha_{k}_us": sig(v * 1e6) for k, v in alphas.items()},
            }
        )
    return fits


def _latency_points(fits: list[dict], offset: float = 0.0) -> list[tuple[int, float]]:
    """``(hops, alpha seconds - offset)`` of every measured kind of every layout in ``fits``."""
    return [
        (ring_hops(k, f["members"]), f[f"alpha_{k}_us"] * 1e-6 - offset)
        for f in fits
        for k in KINDS
    ]


def fit_network(colls: list[dict], world: int, ranks_per_node: int) -> NetworkFit:
    """The network figures of :class:`NetworkFit` from the collective measurements of
    :func:`tetrad.calibrate.measure.measure_collectives` on ``world`` ranks, ``ranks_per_node``
    of them per node (see the module doc)."""
    fits = fit_layouts(colls, world, ranks_per_node)
    intra = [f for f in fits if f["nodes"] == 1]
    inter = [f for f in fits if f["nodes"] > 1]
    base, hop_in = fit_latency(_latency_points(intra))
    node = min(ranks_per_node, world)
    whole = next((f for f in intra if f["stride"] == 1 and f["members"] == node), None)
    intra_gbps = whole["gbps"] if whole else max((f["gbps"] for f in intra), default=0.0)
    if inter:
        inter_pm = min(f["gbps"] / f["members_per_node"] for f in inter)
        hop_x = fit_hop(_latency_points(inter, base))
        if not intra:
            intra_gbps = max(f["gbps"] for f in inter)
    else:
        inter_pm = min(f["gbps"] for f in fits)
        hop_x = hop_in
    return NetworkFit(fits, intra, inter, whole, intra_gbps, inter_pm, base, hop_in, hop_x)
