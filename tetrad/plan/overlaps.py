"""The names of the runtime's overlaps, shared by the runtime and the planner (plain Python)."""

from __future__ import annotations

from collections.abc import Iterable

from tetrad.plan.models import PlanError

OVERLAPS = ("prefetch", "reduce_scatter", "dx_all_reduce", "dp_all_reduce", "domino")
"""What :class:`tetrad.parallel.overlap.Overlap` can overlap and :mod:`tetrad.plan.comm` models."""


def parse_overlaps(text: str | Iterable[str]) -> frozenset[str]:
    """``"all"``, ``"none"`` or a comma-separated subset of :data:`OVERLAPS`.

    Raises:
        PlanError: an unknown name (a ValueError; the message lists the known ones).
    """
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if names == ["all"]:
        return frozenset(OVERLAPS)
    if names in (["none"], []):
        return frozenset()
    bad = [n for n in names if n not in OVERLAPS]
    if bad:
        raise PlanError(
            f"unknown overlap {bad[0]!r}: use all, none or a comma-separated list "
            f"of {', '.join(OVERLAPS)}"
        )
    return frozenset(names)
