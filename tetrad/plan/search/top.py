"""The searches' top-K: the ``K`` fastest configurations timed so far, ties in step time broken
by enumeration order (the lower sequence number wins), so the ranking does not depend on the
order in which configurations are timed. Plain Python (:mod:`heapq`).

The list ``best`` is a heap of ``(-step seconds, -sequence number, item)``: its first entry is
the configuration that leaves first, the slowest (the latest enumerated among equally slow).
"""

from __future__ import annotations

import heapq

PIPELINE_SEQ = 1 << 62
"""Where the pipeline configurations' sequence numbers start: after every 5D one's."""


def offer(best: list, top: int, step: float, seq: int, item) -> None:
    """Keep ``item`` (``step`` seconds, sequence number ``seq``) in ``best`` if it is among the
    ``top`` fastest by ``(step, seq)``."""
    entry = (-step, -seq, item)
    if len(best) < top:
        heapq.heappush(best, entry)
    elif entry > best[0]:
        heapq.heapreplace(best, entry)


def slowest(best: list, top: int) -> float:
    """Seconds a configuration must beat to enter: the slowest kept once ``top`` are kept, else
    infinity."""
    return -best[0][0] if len(best) >= top else float("inf")


def ranked(best: list) -> list[tuple[float, object]]:
    """``(step seconds, item)`` of ``best``, fastest first (ties: enumeration order)."""
    return [(-neg, item) for neg, _, item in sorted(best, key=lambda e: (-e[0], -e[1]))]


def best_first(queue: list, best: list, top: int, visit, margin: float) -> None:
    """Visit the heap ``queue`` of ``(bound seconds, kind, unique number, payload)`` in
    ascending bound (each bound at most the step of every configuration the entry stands for)
    until the next cannot enter ``best``: its bound shrunk by ``margin`` (relative) is not below
    the slowest kept. ``visit(kind, payload)`` times configurations into ``best`` or pushes
    finer entries onto ``queue``."""
    keep = 1.0 - margin
    while queue:
        if queue[0][0] * keep >= slowest(best, top):
            break  # every later entry's bound is at least this one's
        _, kind, _, payload = heapq.heappop(queue)
        visit(kind, payload)
