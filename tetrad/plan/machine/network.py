"""Hierarchical alpha-beta model of one collective on a group of GPUs.

Where a group's ranks sit decides its bandwidth. Ranks are numbered node by node (``gpus_per_node``
consecutive ranks per node), and tetrad's grid puts X innermost, then Y, Z and data (AxoNN's
order, Singh et al., arXiv 2305.13525), so the members of a group over one axis are
``base + i * stride`` for ``i < size`` with ``stride`` the product of the sizes of the axes nested
inside it (X: 1, Y: G_x, Z: G_x G_y, data: G_x G_y G_z). From ``(stride, size)``:

- ``members_per_node`` q (the most members of the group on one node) and ``nodes`` n spanned;
- inside one node (n = 1) the bandwidth is the machine's in-node figure, optionally refined by a
  measured table keyed on ``(stride, members)`` (Frontier's GCD pairs differ by stride);
- across nodes (n > 1) every node runs ``gpus_per_node / q`` such groups at once (all groups of an
  axis communicate together), so they share the node's NICs and one group gets
  ``q * inter_node_gbps_per_member``, capped by the in-node figure.

This reproduces AxoNN's measured ``get_bw(ip, my)`` tables of Megatron-AxoNN
``examples/comm_model.py`` exactly for Perlmutter and Frontier (``ip`` is our ``stride``, ``my``
our ``size``); see ``docs/planner.md``.

Time of one collective (Hockney's alpha-beta model with ring traffic; Thakur et al.,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005, section 4):

    t = latency_base + hops * latency_hop + ring_bytes / bandwidth

ring bytes per rank: all-reduce ``2 (G-1)/G * payload``, all-gather ``(G-1)/G * output``,
reduce-scatter ``(G-1)/G * input``; ``hops`` = ring steps (``G-1``; all-reduce ``2 (G-1)``, or
``2 ceil(log2 G)`` when the double binary tree NCCL picks for latency-bound all-reduces has
fewer). Bandwidths are bus bandwidths in the sense of nccl-tests (ring bytes per rank per second).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
KINDS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER)

GB = 1e9
"""Bytes per GB: bandwidths are given in GB/s = 1e9 bytes/s (AxoNN's mode uses 2^30, see
:mod:`tetrad.plan.comm.axonn`)."""


def ring_bytes(kind: str, payload: float, size: int) -> float:
    """Bytes one rank sends in a ring collective over ``size`` ranks.

    Args:
        kind: ``all_reduce`` (payload = the buffer), ``all_gather`` (payload = the gathered
            output) or ``reduce_scatter`` (payload = the full input).
        payload: bytes.
    """
    if size <= 1:
        return 0.0
    frac = (size - 1) / size
    return 2.0 * frac * payload if kind == ALL_REDUCE else frac * payload


def ring_hops(kind: str, size: int) -> int:
    """Ring steps the latency of one collective over ``size`` ranks is charged for.

    All-reduce ``min(2 (G-1), 2 ceil(log2 G))`` (a ring's reduce-scatter plus all-gather, or the
    double binary tree NCCL picks for latency-bound all-reduces when it has fewer steps); every
    other kind ``G-1``. Zero for a single rank.
    """
    if size <= 1:
        return 0
    if kind == ALL_REDUCE:
        return min(2 * (size - 1), 2 * math.ceil(math.log2(size)))
    return size - 1


def placement(stride: int, size: int, gpus_per_node: int) -> tuple[int, int]:
    """``(members_per_node, nodes)`` of the group ``{i * stride : i < size}``.

    Ranks ``r`` live on node ``r // gpus_per_node``. ``members_per_node`` is the largest number of
    members on one node (the bottleneck node when they are not spread evenly).
    """
    if size <= 1:
        return 1, 1
    if stride % gpus_per_node == 0:
        return 1, size
    if gpus_per_node % stride == 0:
        per = gpus_per_node // stride
        return min(size, per), -(-size // per)
    counts: dict[int, int] = {}
    for i in range(size):
        node = (i * stride) // gpus_per_node
        counts[node] = counts.get(node, 0) + 1
    return max(counts.values()), len(counts)


@dataclass(frozen=True)
class Link:
    """What a group over one axis gets from the network (precomputed per ``(stride, size)``).

    Attributes:
        size: ranks in the group ``G``.
        stride: rank distance between consecutive members.
        members_per_node: ``q``.
        nodes: ``n``.
        bandwidth: bus bandwidth, bytes/s.
        hop_latency: seconds per ring step (in-node or network figure).
        base_latency: seconds per call.
    """

    size: int
    stride: int
    members_per_node: int
    nodes: int
    bandwidth: float
    hop_latency: float
    base_latency: float
    _terms: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def time(self, kind: str, payload: float) -> float:
        """Seconds for one collective of ``kind`` moving ``payload`` bytes (see module doc)."""
        g = self.size
        if g <= 1:
            return 0.0
        terms = self._terms.get(kind)
        if terms is None:  # per kind: the latency and the ring bytes per payload byte
            frac = 2.0 * (g - 1) / g if kind == ALL_REDUCE else (g - 1) / g
            lat = self.base_latency + ring_hops(kind, g) * self.hop_latency
            terms = self._terms[kind] = (lat, frac)
        lat, frac = terms
        return lat + frac * payload / self.bandwidth

    def describe(self) -> str:
        where = "in one node" if self.nodes == 1 else f"{self.members_per_node}/node x {self.nodes}"
        return f"G={self.size} stride={self.stride} ({where}, {self.bandwidth / GB:.0f} GB/s)"


@dataclass(frozen=True)
class Network:
    """Hierarchical alpha-beta network of one machine type.

    Attributes:
        gpus_per_node: GPUs (or GCDs) per node.
        intra_node_gbps: bus bandwidth of a group inside one node, GB/s (default for any
            ``(stride, members)`` not in ``intra_table``).
        inter_node_gbps_per_member: bandwidth per group member on a node for a group that spans
            nodes, GB/s (the node's NIC bandwidth shared by the ``gpus_per_node / q`` groups).
        intra_table: measured in-node bandwidths ``(stride, members, gbps)``; ``stride`` 0 matches
            any stride. An exact stride match wins over a stride-0 entry.
        latency_base_us: per-call latency, microseconds.
        latency_hop_intra_us: per ring step inside a node, microseconds.
        latency_hop_inter_us: per ring step for a group spanning nodes, microseconds.
    """

    gpus_per_node: int
    intra_node_gbps: float
    inter_node_gbps_per_member: float
    intra_table: tuple[tuple[int, int, float], ...] = ()
    latency_base_us: float = 8.4
    latency_hop_intra_us: float = 0.5
    latency_hop_inter_us: float = 2.5
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def bandwidth_gbps(self, stride: int, size: int) -> float:
        """Bus bandwidth (GB/s) of the group ``{i * stride : i < size}``."""
        q, n = placement(stride, size, self.gpus_per_node)
        if n == 1:
            anyst = None
            for st, members, gbps in self.intra_table:
                if members == q:
                    if st == stride:
                        return gbps
                    if st == 0:
                        anyst = gbps
            return anyst if anyst is not None else self.intra_node_gbps
        return min(self.intra_node_gbps, q * self.inter_node_gbps_per_member)

    def link(self, stride: int, size: int) -> Link:
        """The (cached) :class:`Link` of a group with this stride and size."""
        key = (stride, size)
        got = self._cache.get(key)
        if got is None:
            q, n = placement(stride, size, self.gpus_per_node)
            hop = self.latency_hop_intra_us if n == 1 else self.latency_hop_inter_us
            got = Link(
                size,
                stride,
                q,
                n,
                self.bandwidth_gbps(stride, size) * GB,
                hop * 1e-6,
                self.latency_base_us * 1e-6 if size > 1 else 0.0,
            )
            self._cache[key] = got
        return got

    def grid_links(self, grid: tuple[int, ...]) -> dict[str, Link]:
        """Links of the axes of a grid ``(G_data, [G_context,] G_z, G_y, G_x)`` (X innermost)
        and of the whole world. The data group is data x context (``G_data G_context`` ranks
        at stride ``G_z G_y G_x``, :class:`tetrad.spec.grid.Axis`)."""
        d, c, z, y, x = grid if len(grid) == 5 else (grid[0], 1, *grid[1:])
        return {
            "x": self.link(1, x),
            "y": self.link(x, y),
            "z": self.link(x * y, z),
            "context": self.link(x * y * z, c),
            "data": self.link(x * y * z, d * c),
            "world": self.link(1, d * c * z * y * x),
        }
