"""GEMMs fused with their collective over one grid axis (T3 in software, on point-to-point ops).

T3 (Pati et al., arXiv 2401.16677) hides a tensor-parallel collective behind the GEMM that
produces or consumes its data: the GEMM is split into chunks ordered to follow the ring, and each
chunk travels while the next one is computed. Here on point-to-point ops (gloo and NCCL), each
ring step's send to the next rank and receive from the previous one posted together as one
``batch_isend_irecv`` group, so NCCL, which ignores tags and matches point-to-point calls in
order, runs them as one fused pair and no two ranks wait on each other's unposted receive:

    all-gather -> GEMM   out = all_gather(x) @ W^T        x [m, k] per rank, out [G m, n]
        ring step s: this rank holds the rows of rank (r - s) mod G, multiplies them while
        passing them on to rank r + 1 and receiving those of rank (r - s - 1) mod G from r - 1.
    GEMM -> reduce-scatter   out = reduce_scatter(y @ W^T)   y [G m, k], out [m, n] per rank
        ring step s: this rank computes its partial of chunk (r - s - 1) mod G and adds the
        running sum received from r - 1 inside the same GEMM (``addmm``, T3's fold of the
        reduction into the producer), then sends it on; after G - 1 steps it holds chunk r.

Each ring step is split further into ``chunks`` row pieces (uneven splits allowed) so that a
piece is sent as soon as it is computed. Each operator is the other's backward. Rows are split
over the group in axis order, dim 0, as :func:`tetrad.comm.all_gather` and
:func:`tetrad.comm.reduce_scatter` do; the bytes each rank sends are those of the ring
collective, ``(G-1)/G`` of the gathered (or reduced) tensor, recorded on the axis as one call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.comm.collectives import Groups, _axis_info
from tetrad.spec.grid import Axis

_SEND, _RECV = dist.isend, dist.irecv  # the ops of a P2POp


class _Ring:
    """The ring over one axis: neighbours, piece exchange, and the axis record."""

    def __init__(self, grid: Groups, axis: Axis | str, payload: int):
        self.g, self.group = _axis_info(grid, axis)
        me = dist.get_rank()
        self.r = dist.get_group_rank(self.group, me) if self.group is not None else me
        glob = (lambda i: dist.get_global_rank(self.group, i)) if self.group is not None else int
        self.next, self.prev = glob((self.r + 1) % self.g), glob((self.r - 1) % self.g)
        self.log = grid.comm
        self.stats = grid.comm.stats(axis) if grid.comm.enabled else None
        if self.stats is not None:
            self.stats.calls += 1
            self.stats.payload_bytes += payload
            self.stats.bytes += (self.g - 1) / self.g * payload
        self.started = self.log.clock.mark()

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        """Post the send of ``send`` to the next rank and the receive into ``recv`` from the
        previous one as one group (``batch_isend_irecv``); returns its works, to be passed to
        :meth:`wait` exactly once (on gloo a second wait blocks for a send that never comes)."""
        return dist.batch_isend_irecv(
            [
                dist.P2POp(_SEND, send, self.next, self.group, tag),
                dist.P2POp(_RECV, recv, self.prev, self.group, tag),
            ]
        )

    def wait(self, works: list) -> None:
        """Wait for one :meth:`exchange` (its send and its receive), timed as exposed (on the
        log's clock: the host with gloo, the computation's stream with NCCL)."""
        t0 = self.log.clock.mark()
        for work in works:
            work.wait()
        if self.stats is not None:
            self.log.add_time(self.stats, "exposed_s", t0, self.log.clock.mark())

    def close(self) -> None:
        if self.stats is not None:
            self.log.add_time(self.stats, "time_s", self.started, self.log.clock.mark())


def _pieces(rows: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` (start, stop) row ranges covering ``rows`` (uneven allowed)."""
    if chunks < 1:
        raise ValueError(f"chunks={chunks}: give at least 1 piece per ring step")
    bounds = [rows * i // chunks for i in range(chunks + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def ring_all_gather_matmul(
    x: torch.Tensor, w: torch.Tensor, grid: Groups, axis: Axis | str, chunks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``all_gather(x) @ w^T`` with the gather hidden behind the GEMM (no autograd).

    Args:
        x: ``[m, k]`` this rank's rows; w: ``[n, k]``; chunks: pieces per ring step.
    Returns:
        ``(out [G m, n], gathered x [G m, k])``.
    """
    ring = _Ring(grid, axis, x.numel() * x.element_size() * _axis_info(grid, axis)[0])
    g, r, m = ring.g, ring.r, x.shape[0]
    full = torch.empty((g * m, x.shape[1]), dtype=x.dtype, device=x.device)
    full[r * m : (r + 1) * m] = x
    out = torch.empty((g * m, w.shape[0]), dtype=torch.result_type(x, w), device=x.device)
    pending: dict[tuple[int, int], list] = {}
    for s in range(g):
        c, nxt = (r - s) % g, (r - s - 1) % g
        for q, (a, b) in enumerate(_pieces(m, chunks)):
            if (s, q) in pending:
                ring.wait(pending.pop((s, q)))
            piece = full[c * m + a : c * m + b]
            if s < g - 1:
                pending[(s + 1, q)] = ring.exchange(
                    piece, full[nxt * m + a : nxt * m + b], s * chunks + q
                )
            torch.matmul(piece, w.t(), out=out[c * m + a : c * m + b])
    ring.close()
    return out, full


def ring_matmul_reduce_scatter(
    y: torch.Tensor, w: torch.Tensor, grid: Groups, axis: Axis | str, chunks: int = 1
) -> torch.Tensor:
    """``reduce_scatter(y @ w^T)`` with the reduction folded into the GEMM (no autograd).

    Args:
        y: ``[G m, k]``; w: ``[n, k]``; chunks: pieces per ring step.
    Returns:
        ``[m, n]``: this rank's rows of the sum over the group.

    Raises:
        ValueError: ``y``'s rows do not split evenly over the group.
    """
    g = _axis_info(grid, axis)[0]
    if y.shape[0] % g:
        raise ValueError(f"{y.shape[0]} rows do not split over a group of {g}: pad the rows")
    m, n = y.shape[0] // g, w.shape[0]
    dtype = torch.result_type(y, w)
    ring = _Ring(grid, axis, y.shape[0] * n * torch.empty((), dtype=dtype).element_size())
    r = ring.r
    acc = [torch.empty((m, n), dtype=dtype, device=y.device) for _ in range(2)]
    pending: dict[tuple[int, int], list] = {}
    for s in range(g):
        c = (r - s - 1) % g
        cur, nxt_buf = acc[s % 2], acc[(s + 1) % 2]
        for q, (a, b) in enumerate(_pieces(m, chunks)):
            rows = y[c * m + a : c * m + b]
            if s == 0:
                torch.matmul(rows, w.t(), out=cur[a:b])
            else:
                # the previous step's group: its receive into cur[a:b] and its send out of
                # nxt_buf[a:b], which this step receives into next
                ring.wait(pending.pop((s, q)))
                cur[a:b].addmm_(rows, w.t())  # the neighbour's running sum + this partial
            if s < g - 1:
                pending[(s + 1, q)] = ring.exchange(cur[a:b], nxt_buf[a:b], s * chunks + q)
    ring.close()
    return acc[(g - 1) % 2]


class AllGatherMatmul(torch.autograd.Function):
    """``all_gather(x) @ w^T``; backward: ``dx`` by :func:`ring_matmul_reduce_scatter` of
    ``dout @ w`` (the other fused operator), ``dw = dout^T all_gather(x)``."""

    @staticmethod
    def forward(ctx, x, w, grid, axis, chunks):
        out, full = ring_all_gather_matmul(x, w, grid, axis, chunks)
        ctx.save_for_backward(full, w)
        ctx.grid, ctx.axis, ctx.chunks = grid, axis, chunks
        return out

    @staticmethod
    def backward(ctx, dout):
        full, w = ctx.saved_tensors
        dx = ring_matmul_reduce_scatter(dout, w.t(), ctx.grid, ctx.axis, ctx.chunks)
        return dx, dout.t() @ full, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """``reduce_scatter(y @ w^T)``; backward: ``dy`` by :func:`ring_all_gather_matmul` of the
    output gradient with ``w^T`` (the other fused operator), ``dw = all_gather(dout)^T y``."""

    @staticmethod
    def forward(ctx, y, w, grid, axis, chunks):
        ctx.save_for_backward(y, w)
        ctx.grid, ctx.axis, ctx.chunks = grid, axis, chunks
        return ring_matmul_reduce_scatter(y, w, grid, axis, chunks)

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        dy, dout_full = ring_all_gather_matmul(
            dout.contiguous(), w.t(), ctx.grid, ctx.axis, ctx.chunks
        )
        return dy, dout_full.t() @ y, None, None, None


def all_gather_matmul(
    x: torch.Tensor, w: torch.Tensor, grid: Groups, axis: Axis | str, chunks: int = 1
) -> torch.Tensor:
    """``all_gather(x, axis) @ w^T``, differentiable: ``x [m, k]`` per rank (rows split over
    the axis in axis order), ``w [n, k]`` -> ``[G m, n]``. A group of 1 is a plain GEMM."""
    if _axis_info(grid, axis)[0] == 1:
        return x @ w.t()
    return AllGatherMatmul.apply(x, w, grid, axis, chunks)


def matmul_reduce_scatter(
    y: torch.Tensor, w: torch.Tensor, grid: Groups, axis: Axis | str, chunks: int = 1
) -> torch.Tensor:
    """``reduce_scatter(y @ w^T, axis)``, differentiable: ``y [G m, k]``, ``w [n, k]`` ->
    ``[m, n]``, this rank's rows of the sum over the axis. A group of 1 is a plain GEMM.

    Raises:
        ValueError: ``G`` does not divide the rows of ``y``.
    """
    if _axis_info(grid, axis)[0] == 1:
        return y @ w.t()
    return MatmulReduceScatter.apply(y, w, grid, axis, chunks)
