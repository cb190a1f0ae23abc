"""The runtime's stage split for blocks of equal cost, fast (:func:`uniform_split`): the split
:func:`tetrad.spec.pipeline_split.balanced_split` returns for ``[1.0] * n`` blocks, computed from
the
same recurrence in ``O((n + stages) log n)`` steps instead of its ``O(stages n^2)``. Plain
Python.

``balanced_split`` is a dynamic programme: ``best[s][a]``, the least largest stage cost of blocks
``a..n`` in stages ``s..``, is the least over the end ``b`` of stage ``s`` of ``max(cost(s, a,
b), best[s + 1][b])``; the split follows the first ``b`` that reaches it from ``a = 0``. For
blocks of cost 1:

- for ``s >= 1`` (no embedding) ``best[s][a]`` depends only on ``N = n - a`` blocks and ``T``
  stages, the last with the head's cost ``h``: ``N + h`` for ``T = 1``; else the least over the
  last stage's ``x >= 0`` blocks (the last stage may be empty) of ``max(ceil((N - x) / (T -
  1)), x + h)`` (the other stages even), a non-increasing then increasing function of ``x``
  (:func:`_suffix_best`);
- ``cost(s, a, b)`` grows with ``b`` and ``best[s + 1][b]`` does not (dropping a block from a
  suffix never raises its best), so ``max`` of the two falls and then rises: the first ``b``
  reaching the least is found walking ``b`` up from ``a + 1`` until it rises.

Every cost is then a sum of whole blocks and the embedding's and head's costs; with those
multiples of 1/4 (as :func:`tetrad.plan.pipe.pipeline_step.split_ranks` rounds them) every value is
exact in floating point, so the comparisons are the programme's own (its ``1e-12`` tolerance
never decides between values 1/4 apart).
"""

from __future__ import annotations

import functools


def exact_quarters(*values: float) -> bool:
    """Whether every value is a multiple of 1/4 below ``2^20`` (exact sums, see module doc)."""
    return all((4.0 * v).is_integer() and 0.0 <= v < 2.0**20 for v in values)


def uniform_split(
    n_blocks: int, first_extra: float, last_extra: float, stages: int
) -> tuple[tuple[int, int], ...]:
    """``balanced_split([1.0] * n_blocks, first_extra, last_extra, stages)`` (module doc), for
    ``1 <= stages <= n_blocks`` and extras that :func:`exact_quarters` accepts.

    Raises:
        ValueError: stages out of range or extras not exact.
    """
    if not 1 <= stages <= n_blocks or not exact_quarters(first_extra, last_extra):
        raise ValueError(f"uniform_split({n_blocks}, {first_extra}, {last_extra}, {stages})")
    n, h = n_blocks, float(last_extra)

    def suffix(b: int, s: int) -> float:  # best[s][b] for s >= 1
        t = stages - s
        if t == 0:
            return 0.0 if b == n else float("inf")
        return _suffix_best(n - b, t, h)

    split, a = [], 0
    for s in range(stages):
        extra = (first_extra if s == 0 else 0.0) + (h if s == stages - 1 else 0.0)
        stop_max = n - max(0, stages - 2 - s)  # the stages after s need a block each, the last none
        if s == stages - 1:
            split.append((a, n))
            break
        best, cut = float("inf"), stop_max
        for b in range(a + 1, stop_max + 1):
            worst = max(float(b - a) + extra, suffix(b, s + 1))
            if worst < best - 1e-12 * max(1.0, worst):
                best, cut = worst, b
            elif worst > best:
                break  # rising: no later b is as low
        split.append((a, cut))
        a = cut
    return tuple(split)


@functools.lru_cache(maxsize=1 << 16)
def _suffix_best(blocks: int, stages: int, head: float) -> float:
    """The least largest stage cost of ``blocks`` unit blocks in ``stages`` stages, the last
    with ``head`` more and perhaps no block (``blocks >= stages - 1 >= 0``; module doc;
    memoised: the splits of every ``p`` and ``v`` of a model share them)."""
    if stages == 1:
        return float(blocks) + head

    def even(x: int) -> int:  # the largest of the other stages when the last has x blocks
        return -(-(blocks - x) // (stages - 1))

    lo, hi = 0, blocks - stages + 1  # the first x with x + head >= even(x), or hi
    while lo < hi:
        mid = (lo + hi) // 2
        if mid + head >= even(mid):
            hi = mid
        else:
            lo = mid + 1
    out = max(lo + head, float(even(lo)))
    if lo > 0:  # below lo the other stages are the largest
        out = min(out, float(even(lo - 1)))
    return float(out)
