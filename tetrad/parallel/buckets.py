"""Data-parallel gradient all-reduce in buckets, issued during backward as gradients complete.

Gradients are appended to a bucket as they become ready (in backward order); a full bucket
(``bucket_bytes``) is flattened into one buffer and all-reduced over the data axis
asynchronously, so the reduction of late layers runs while earlier layers compute their
backward. The bucket that receives the step's last weight gradient (the embedding's, at the very
end of backward) is not launched when full but by :meth:`GradBuckets.finish`, which adds to it
the gradients that autograd accumulates itself (norm weights: no hook tells when they are
complete), launches it, waits for every bucket and makes each ``param.grad`` a view of its
bucket's reduced buffer (no copy back; DDP's ``gradient_as_bucket_view`` keeps gradients in its
buckets likewise). (The structure follows picotron's ``data_parallel/bucket.py``; AxoNN leaves
this all-reduce synchronous.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from tetrad.comm import Handle, all_reduce
from tetrad.grid import Grid
from tetrad.spec import DP_BUCKET_BYTES, Axis


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

    def clear(self) -> None:
        """Start a new optimizer step: nothing reduced yet."""
        self.reduced, self._added = set(), 0

    def add(self, param: nn.Parameter) -> None:
        """Queue ``param.grad`` (complete for this step); launch the bucket when it is full,
        unless ``param`` is the step's last weight gradient (:attr:`expected`)."""
        self._queue(param)
        self._added += 1
        if self._bucket_size >= self.bucket_bytes and self._added != self.expected:
            self._launch()

    def _queue(self, param: nn.Parameter) -> None:
        self._bucket.append(param)
        self._bucket_size += param.grad.numel() * param.grad.element_size()
        self.reduced.add(id(param))

    def finish(self, late: Iterable[nn.Parameter] = ()) -> None:
        """Add ``late`` (gradients complete now; all of them to the last bucket, however full),
        launch the last bucket, wait for all, and make each ``param.grad`` a view of the sums."""
        for p in late:
            if p.grad is not None:
                self._queue(p)
        self._launch()
        for params, handle in self._launched:
            flat, offset = handle.wait(), 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._launched = []

    def _launch(self) -> None:
        if self._bucket:
            flat = torch.cat([p.grad.reshape(-1) for p in self._bucket])
            handle = all_reduce(flat, self.grid, Axis.DATA, async_op=True)
            self._launched.append((self._bucket, handle))
            self.counts["dp_buckets"] += 1
        self._bucket, self._bucket_size = [], 0
