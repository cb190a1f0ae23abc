"""Overlap of collectives with computation: which ones, and the state that makes it happen.

Five overlaps, each switchable (AxoNN, arXiv 2305.13525, "aggressively overlap expensive
collective operations"; Domino, arXiv 2409.15241, for the forward split):

``prefetch``        the Z all-gather of the next weight in *execution* order (recorded on the first
                    training micro-batch, so it covers forward, backward and activation
                    recomputation) is issued while the current layer computes;
``reduce_scatter``  the Z reduce-scatter of each weight gradient is issued asynchronously and
                    completed before the optimizer step;
``dx_all_reduce``   the backward all-reduce of the input gradient runs during the dW GEMM;
``dp_all_reduce``   data-parallel gradient all-reduces are bucketed and issued during the last
                    micro-batch's backward as buckets fill (AxoNN leaves this synchronous);
``domino``          the forward activation all-reduce: the micro-batch's rows are split in two so
                    the first half's all-reduce runs during the second half's GEMM.

All collectives are issued from the main thread in program order, so every rank of a group issues
the same sequence. Waits use the work handles only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from tetrad.comm import Handle, all_gather, all_reduce, reduce_scatter
from tetrad.grid import Grid
from tetrad.parallel.buckets import GradBuckets
from tetrad.spec import DOMINO_MIN_ROWS, DP_BUCKET_BYTES, OVERLAPS, Axis


class Overlap:
    """Switches and state of the overlaps of one model on one grid.

    The training step drives it: :meth:`begin_micro_batch` before a micro-batch's forward,
    :meth:`end_micro_batch` after its backward (waits outstanding reduce-scatters and, on the
    last micro-batch, the data-parallel all-reduces of :attr:`buckets`, a
    :class:`~tetrad.parallel.buckets.GradBuckets`). Outside a training step (evaluation) every
    collective is blocking and nothing is prefetched.

    Args:
        enabled: names from :data:`OVERLAPS`.
        bucket_bytes: data-parallel bucket size in bytes.
        domino_min_rows: split the forward GEMM only when the micro-batch has at least twice
            this many token rows (below it the split's extra launch costs more than it hides).
    """

    def __init__(
        self,
        grid: Grid,
        enabled: Iterable[str] = OVERLAPS,
        bucket_bytes: int = DP_BUCKET_BYTES,
        domino_min_rows: int = DOMINO_MIN_ROWS,
    ):
        self.grid = grid
        self.enabled = frozenset(enabled)
        self.domino_min_rows = domino_min_rows
        self._in_step = self._last = False
        self._order: list | None = None  # [(param, dtype)] of one micro-batch, in execution order
        self._recording: list | None = None
        self._pos = 0
        self._prefetched: tuple | None = None  # (param, dtype, Handle)
        self._pending_rs: list[tuple[torch.nn.Parameter, Handle]] = []
        # What actually ran (prefetch_hits, prefetch_misses, async_reduce_scatters, dp_buckets,
        # domino_splits, async_dx_all_reduces), for logs and tests; reset by the caller.
        self.counts: Counter[str] = Counter()
        self.buckets = GradBuckets(grid, bucket_bytes, self.counts)

    def on(self, name: str) -> bool:
        return name in self.enabled

    # -- step protocol -------------------------------------------------------------------
    def begin_micro_batch(self, last: bool) -> None:
        """Start a training micro-batch (``last``: the step's final one)."""
        self._in_step, self._last, self._pos = True, last, 0
        if last:
            self.buckets.clear()
        if self._order is None and self.on("prefetch"):
            self._recording = []

    def end_micro_batch(self) -> None:
        """Finish the micro-batch: complete reduce-scatters; on the last one, the data-parallel
        buckets. Afterwards every weight gradient is in ``param.grad``."""
        while self._pending_rs:
            self._finish_rs(*self._pending_rs.pop(0))
        if self._last:
            self.buckets.finish()
        if self._recording is not None:
            self._order, self._recording = self._recording, None
        self._drop_prefetch()
        self._in_step = False

    # -- weights: all-gather over Z ------------------------------------------------------
    def gather_weight(self, param: torch.nn.Parameter, dtype: torch.dtype) -> torch.Tensor:
        """The Z all-gather of ``param`` (a dim-0 shard) cast to ``dtype``: prefetched when it
        was, and the next weight of the recorded order issued before returning."""
        got = None
        if self._prefetched is not None:
            p, dt, h = self._prefetched
            self._prefetched = None
            w = h.wait()
            if p is param and dt == dtype:
                got = w
                self.counts["prefetch_hits"] += 1
            else:
                self.counts["prefetch_misses"] += 1
        if got is None:
            got = all_gather(param.detach().to(dtype), self.grid, Axis.Z)
        if self._in_step and self.on("prefetch"):
            if self._recording is not None:
                self._recording.append((param, dtype))
            elif self._order is not None:
                self._prefetch_next(param)
        return got

    def _prefetch_next(self, param) -> None:
        order, pos = self._order, self._pos
        if pos >= len(order) or order[pos][0] is not param:  # order broken: stop prefetching
            self._pos = len(order)
            return
        self._pos += 1
        if self._pos < len(order):
            nxt, dt = order[self._pos]
            with torch.no_grad():
                h = all_gather(nxt.detach().to(dt), self.grid, Axis.Z, async_op=True)
            self._prefetched = (nxt, dt, h)

    def _drop_prefetch(self) -> None:
        if self._prefetched is not None:
            self._prefetched[2].wait()
            self._prefetched = None

    # -- weight gradients: reduce-scatter over Z, then all-reduce over data --------------
    def reduce_weight_grad(self, param: torch.nn.Parameter, block_grad: torch.Tensor) -> None:
        """Sum a full-block weight gradient over Z into ``param.grad`` (this rank's rows),
        asynchronously when ``reduce_scatter`` overlap is on."""
        if self._in_step and self.on("reduce_scatter"):
            self._pending_rs.append(
                (param, reduce_scatter(block_grad, self.grid, Axis.Z, async_op=True))
            )
            self.counts["async_reduce_scatters"] += self.grid.z > 1
            while (
                self._pending_rs
                and self._pending_rs[0][1].work is not None
                and self._pending_rs[0][1].work.is_completed()
            ):
                self._finish_rs(*self._pending_rs.pop(0))
        else:
            self._grad_ready(param, reduce_scatter(block_grad, self.grid, Axis.Z))

    def _finish_rs(self, param, handle: Handle) -> None:
        self._grad_ready(param, handle.wait())

    def _grad_ready(self, param, shard: torch.Tensor) -> None:
        if param.grad is None:
            param.grad = shard
        else:
            param.grad += shard
        if self._in_step and self._last and self.on("dp_all_reduce") and self.grid.data > 1:
            self.buckets.add(param)

    # -- activations -----------------------------------------------------------------------
    def forward_all_reduce_split(self, axis: Axis, rows: int) -> bool:
        """Whether to split a forward GEMM + all-reduce over ``axis`` in two halves."""
        split = (
            self._in_step
            and self.on("domino")
            and self.grid.size(axis) > 1
            and rows >= 2 * self.domino_min_rows
        )
        self.counts["domino_splits"] += split
        return split

    def backward_all_reduce(self, dx: torch.Tensor, axis: Axis) -> Handle:
        """Start the dx all-reduce; returns a :class:`Handle` (async when ``dx_all_reduce``)."""
        if self._in_step and self.on("dx_all_reduce"):
            self.counts["async_dx_all_reduces"] += self.grid.size(axis) > 1
            return all_reduce(dx, self.grid, axis, async_op=True)
        return Handle(None, all_reduce(dx, self.grid, axis), None, 0.0)
