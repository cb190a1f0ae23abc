"""Data-parallel gradient all-reduce in buckets, issued during backward as gradients complete.

Gradients are appended to a bucket as they become ready (in backward order); a full bucket
(``bucket_bytes``) is flattened into one buffer and all-reduced over the data axis
asynchronously, so the reduction of late layers runs while earlier layers compute their
backward. The bucket that receives the step's last weight gradient (the embedding's, at the very
end of backward) is not launched when full but by :meth:`GradBuckets.finish`, which adds to it
the gradients that autograd accumulates itself (norm weights: no hook tells when they are
complete), launches it, waits for every bucket and makes each ``param.grad`` a view of its
bucket's reduced buffer (no copy back; DDP's ``gradient_as_bucket_view`` keeps gradients in its
buckets likewise).

No copy in either, where the layers can help: :meth:`GradBuckets.plan` lays the buckets out in
advance for gradients arriving in a given order (the model passes its parameters in reverse
order, which is backward's), and :meth:`GradBuckets.slot` then hands a layer the place of its
gradient in its bucket's buffer, into which the weight-gradient GEMM writes directly. A bucket
whose gradients all sit in place is all-reduced as it is; the late gradients are copied into
their places; later micro-batches of a step accumulate in place; a bucket that does not match
the plan (another order) is flattened with ``torch.cat`` as before, and the plan is remade from
the order seen. (DDP likewise assigns buckets by reverse parameter order and rebuilds them after
the first step.)
(The structure follows picotron's ``data_parallel/bucket.py``; AxoNN leaves this all-reduce
synchronous.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from tetrad.comm import Handle, all_reduce
from tetrad.grid import Grid
from tetrad.parallel.masters import grad_dtype, grad_of, reduce_dtype, set_grad
from tetrad.parallel.zero import DataShards
from tetrad.spec.grid import Axis
from tetrad.spec.overlap import DP_BUCKET_BYTES


class GradBuckets:
    """Buckets of weight gradients all-reduced over the data axis of ``grid``.

    Args:
        bucket_bytes: launch a bucket once its gradients hold at least this many bytes.
        counts: counter that receives ``dp_buckets`` (buckets launched), for logs and tests.

    Attributes:
        reduced: ids of the parameters whose gradients were summed over data since
            :meth:`clear` (gradient sync then skips the data axis for them).
        expected: weight gradients :meth:`add` receives per step (set by the model; None:
            unknown). The bucket that the last of them completes waits for :meth:`finish`, so
            the late gradients ride in it instead of a call of their own.
        shards: with the sharded optimizer (set by the training step), a bucket is
            reduce-scattered over data instead of all-reduced
            (:meth:`tetrad.parallel.zero.DataShards.reduce_scatter`) and :meth:`finish` leaves
            this rank's pieces in ``shards.grads`` (``param.grad`` keeps the local sum).
    """

    def __init__(
        self, grid: Grid, bucket_bytes: int = DP_BUCKET_BYTES, counts: Counter | None = None
    ):
        self.grid, self.bucket_bytes = grid, bucket_bytes
        self.counts = counts if counts is not None else Counter()
        self.reduced: set[int] = set()
        self.expected: int | None = None
        self._added = 0
        self._bucket: list[nn.Parameter] = []
        self._bucket_size = 0
        self._launched: list[tuple[list[nn.Parameter], Handle]] = []
        self._late: list[nn.Parameter] = []
        self._plan: list[list[tuple[nn.Parameter, int]]] = []  # per bucket: (param, offset)
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, offset)
        self._flats: dict[int, torch.Tensor] = {}  # bucket -> its buffer, once a slot is taken
        self._off_plan = False  # a bucket this step was not the planned one
        self.shards: DataShards | None = None

    def clear(self) -> None:
        """Start a new optimizer step: nothing reduced yet."""
        self.reduced, self._added = set(), 0

    def plan(self, order: list[nn.Parameter], late: list[nn.Parameter] = ()) -> None:
        """Lay out the buckets for weight gradients that :meth:`add` receives in ``order``
        (the rule of :meth:`add`, with :attr:`expected` ``= len(order)``), ``late`` at the end
        of the last bucket (:meth:`finish`). Parameters of mixed dtypes or devices: no plan."""
        self._plan, self._where, self._late = [], {}, list(late)
        params = [*order, *late]
        if len({(grad_dtype(p), p.device) for p in params}) > 1:
            return
        bucket, size = [], 0
        for i, p in enumerate(order):
            bucket.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes and i + 1 != len(order):
                self._plan.append(self._offsets(bucket))
                bucket, size = [], 0
        self._plan.append(self._offsets([*bucket, *late]))
        for b, entries in enumerate(self._plan):
            for p, offset in entries:
                self._where[id(p)] = (b, offset)

    @staticmethod
    def _offsets(params: list[nn.Parameter]) -> list[tuple[nn.Parameter, int]]:
        offsets, offset = [], 0
        for p in params:
            offsets.append((p, offset))
            offset += p.numel()
        return offsets

    def slot(self, param: nn.Parameter) -> torch.Tensor | None:
        """The place of ``param``'s gradient in its planned bucket's buffer, shaped like
        ``param`` (the buffer is allocated when its first slot is taken and lives until
        :meth:`finish`, as the gradients); None when ``param`` is not in the plan or already has
        a gradient (one written elsewhere is copied in at launch)."""
        where = self._where.get(id(param))
        if where is None or grad_of(param) is not None or self.shards is not None:
            return None  # sharded: the reduce-scatter packs the gradients anyway
        b, offset = where
        flat = self._flats.get(b)
        if flat is None:
            p, last = self._plan[b][-1]
            flat = torch.empty(last + p.numel(), dtype=grad_dtype(param), device=param.device)
            self._flats[b] = flat
        return flat[offset : offset + param.numel()].view_as(param)

    def add(self, param: nn.Parameter) -> None:
        """Queue ``param.grad`` (complete for this step); launch the bucket when it is full,
        unless ``param`` is the step's last weight gradient (:attr:`expected`)."""
        self._queue(param)
        self._added += 1
        if self._bucket_size >= self.bucket_bytes and self._added != self.expected:
            self._launch()

    def _queue(self, param: nn.Parameter) -> None:
        self._bucket.append(param)
        g = grad_of(param)
        self._bucket_size += g.numel() * g.element_size()
        self.reduced.add(id(param))

    def finish(self, late: Iterable[nn.Parameter] = ()) -> None:
        """Add ``late`` (gradients complete now; all of them to the last bucket, however full),
        launch the last bucket, wait for all, and make each ``param.grad`` a view of the sums."""
        for p in late:
            if grad_of(p) is not None:
                self._queue(p)
        self._launch()
        seen = []
        for params, handle in self._launched:
            flat, offset = handle.wait().to(grad_dtype(params[0])), 0
            seen += params
            if self.shards is not None:
                self.shards.take(params, flat)
                continue
            for p in params:
                set_grad(p, flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        if self._off_plan:  # lay the buckets out as backward met the gradients this time
            late = {id(p) for p in self._late}
            self.plan([p for p in seen if id(p) not in late], self._late)
        self._launched, self._flats, self._off_plan = [], {}, False

    def _launch(self) -> None:
        if self._bucket:
            if self.shards is not None:  # packed from the gradients (no slot was handed out)
                grads = [grad_of(p) for p in self._bucket]
                handle = self.shards.reduce_scatter(self._bucket, grads, async_op=True)
            else:
                flat = self._in_place(len(self._launched))
                if flat is None:
                    flat = torch.cat([grad_of(p).reshape(-1) for p in self._bucket])
                flat = flat.to(reduce_dtype(self._bucket[0]))  # no copy where the same
                handle = all_reduce(flat, self.grid, Axis.DATA, async_op=True)
            self._launched.append((self._bucket, handle))
            self.counts["dp_buckets"] += 1
        self._bucket, self._bucket_size = [], 0

    def _in_place(self, b: int) -> torch.Tensor | None:
        """Bucket ``b``'s planned buffer with every gradient of the pending bucket in its place
        (those not written there are copied in), or None when the bucket is not the planned
        one (or no slot of it was taken)."""
        flat = self._flats.pop(b, None)
        if flat is None or [id(p) for p in self._bucket] != [id(p) for p, _ in self._plan[b]]:
            self._off_plan = bool(self._plan)
            return None
        for p, offset in self._plan[b]:
            place = flat[offset : offset + p.numel()]
            g = grad_of(p)
            if g.data_ptr() != place.data_ptr():
                place.copy_(g.reshape(-1))
        return flat
