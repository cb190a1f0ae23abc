"""The Z axis's collectives of one micro-batch replayed on one stream, in issue order (the
``prefetch`` and ``reduce_scatter`` overlaps of :mod:`tetrad.plan.step_time`; the runtime is
:class:`tetrad.parallel.overlap.Overlap`).

Collectives on one axis share one communicator, hence one stream: each starts when it is issued
or when the one before it ends, whichever is later. The compute runs through a sequence of
*uses*, one per Z all-gathered weight in execution order (:class:`Use`: the weight's all-gather,
the compute window up to the next use, the reduce-scatter of its gradient). At a use the compute
waits for the weight's all-gather (the stall is exposed), then, with ``prefetch``, issues the
all-gathers of the next :data:`tetrad.spec.overlap.PREFETCH_DEPTH` uses not yet issued, then the
reduce-scatters deferred since the last use, then computes the window; a reduce-scatter is
deferred while the micro-batch has uses left, else issued at once. Issuing one, the compute
waits for the oldest beyond :data:`tetrad.spec.overlap.REDUCE_SCATTERS_IN_FLIGHT` (the runtime
finishes it there). Without ``prefetch`` every
all-gather is issued at its use (blocking); without ``reduce_scatter`` every reduce-scatter is
issued and waited at once. After the last use come the tail (the embedding's backward, then its
reduce-scatters) and the wait for everything still queued.

A stall is charged to the collectives that occupy the stream while the compute waits, each for
the seconds it runs in that interval (the stream is busy throughout: the awaited collective was
issued before the wait).

With ``wrap`` (the runtime's order running on into the step's next micro-batch) the first uses
of the next micro-batch are prefetched by the last uses of this one, and those of this one come
complete from the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.spec.overlap import PREFETCH_DEPTH, REDUCE_SCATTERS_IN_FLIGHT

Key = tuple[str, str]
"""``(layer, phase)``: ``("wqkv", "forward")``, ``("output", "backward")`` ..."""

_DONE = float("-inf")


@dataclass(slots=True)
class Use:
    """One use of a Z-gathered weight.

    Attributes:
        ag: key of its all-gather; ``ag_s`` its seconds.
        window: compute seconds from the use to the next one.
        rs: key of the reduce-scatter its layer issues during the window (None: none);
            ``rs_s`` its seconds.
        mult: how many such uses this one stands for (blocks alike: the middle blocks' uses
            stand for ``L - 2`` each).
    """

    ag: Key
    ag_s: float
    window: float
    rs: Key | None = None
    rs_s: float = 0.0
    mult: float = 1.0


class ZQueue:
    """The Z stream of one rank, replayed (module doc). ``gather[key]`` and ``scatter[key]``
    accumulate the exposed seconds of each collective over every :meth:`micro_batch` walked.

    Args:
        prefetch: the ``prefetch`` overlap; async_scatter: the ``reduce_scatter`` overlap.
    """

    def __init__(self, prefetch: bool, async_scatter: bool):
        self.pre, self.rsa = prefetch, async_scatter
        self.gather: dict[Key, float] = {}
        self.scatter: dict[Key, float] = {}
        self.trace: list | None = None
        """With a list here, every collective issued appends ``(key, is all-gather)``."""

    # ---- the stream --------------------------------------------------------------------------

    def _issue(self, key: Key, seconds: float, gather: bool) -> float:
        start = self.t if self.t > self.free else self.free
        self.free = end = start + seconds
        self.items.append((key, gather, start, end))
        if self.trace is not None:
            self.trace.append((key, gather))
        return end

    def _wait(self, end: float, mult: float) -> None:
        """Compute waits until ``end``; the stall is charged to what runs meanwhile."""
        lo = self.t
        if end <= lo:
            return
        keep = []
        for item in self.items:
            key, gather, s, e = item
            if e <= lo:
                continue
            run = (e if e < end else end) - (s if s > lo else lo)
            if run > 0.0:
                d = self.gather if gather else self.scatter
                d[key] = d.get(key, 0.0) + mult * run
            keep.append(item)
        self.items = keep
        self.t = end

    # ---- one micro-batch ---------------------------------------------------------------------

    def micro_batch(
        self,
        uses: list[Use],
        tail: float,
        tail_rs: list[tuple[Key, float]],
        *,
        wrap_in: bool,
        wrap_out: bool,
        mult: float,
    ) -> None:
        """Walk one micro-batch (``mult`` such micro-batches): ``uses`` in order, then ``tail``
        compute seconds and the reduce-scatters ``tail_rs`` issued after it, then the wait for
        the stream. ``wrap_in``: the first :data:`PREFETCH_DEPTH` uses come prefetched and
        complete; ``wrap_out``: the last uses prefetch the next micro-batch's first ones."""
        self.t, self.free, self.items, self.rs_ends = 0.0, 0.0, [], []
        n, depth = len(uses), PREFETCH_DEPTH
        wrap_in, wrap_out = wrap_in and self.pre, wrap_out and self.pre
        ends: list[float | None] = [None] * n
        issued = -1
        if wrap_in:
            issued = min(depth, n) - 1
            for k in range(issued + 1):
                ends[k] = _DONE
        deferred: list[Use] = []
        for j, u in enumerate(uses):
            m = mult * u.mult
            end = ends[j]
            if end is None:  # not prefetched: blocking
                end = self._issue(u.ag, u.ag_s, True)
                issued = max(issued, j)
            self._wait(end, m)
            if self.pre:
                while issued < j + depth:
                    issued += 1
                    if issued < n:
                        ends[issued] = self._issue(uses[issued].ag, uses[issued].ag_s, True)
                    elif wrap_out and issued - n < n:
                        nxt = uses[issued - n]
                        self._issue(nxt.ag, nxt.ag_s, True)
            for d in deferred:
                self._scatter(d.rs, d.rs_s, m)
            deferred = []
            self.t += u.window
            if u.rs is not None:
                if not self.rsa:
                    self._wait(self._issue(u.rs, u.rs_s, False), m)
                elif self.pre and j + 1 < n:
                    deferred.append(u)
                else:
                    self._scatter(u.rs, u.rs_s, m)
        self.t += tail
        for key, seconds in tail_rs:
            if self.rsa:
                self._scatter(key, seconds, mult)
            else:
                self._wait(self._issue(key, seconds, False), mult)
        self._wait(self.free, mult)

    def _scatter(self, key: Key, seconds: float, mult: float) -> None:
        """Issue an asynchronous reduce-scatter; the compute then waits for the oldest beyond
        :data:`~tetrad.spec.overlap.REDUCE_SCATTERS_IN_FLIGHT` (the runtime finishes it there,
        and the stream runs it after everything issued before it)."""
        self.rs_ends.append(self._issue(key, seconds, False))
        while len(self.rs_ends) > REDUCE_SCATTERS_IN_FLIGHT:
            self._wait(self.rs_ends.pop(0), mult)
