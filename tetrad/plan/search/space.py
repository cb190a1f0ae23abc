"""The spaces both planner searches enumerate: divisors and ordered factorisations of the GPU
count, the checkpointing modes to try, and the checks of the question. Plain Python."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tetrad.plan.errors import PlanError
from tetrad.spec.activation_checkpointing import parse_checkpointing
from tetrad.spec.model import ModelSpec
from tetrad.spec.sharding import grid_problems


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


@functools.lru_cache(maxsize=1 << 12)
def divisors_of(n: int) -> tuple[int, ...]:
    """:func:`divisors` of ``n`` as a tuple, memoised (the searches' inner loops)."""
    return tuple(divisors(n))


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, parts - 1)]


def checkpointing_modes(checkpointing: Iterable[str | bool]) -> tuple[str, ...]:
    """Distinct modes of :data:`tetrad.spec.activation_checkpointing.CHECKPOINTING` from names or
    bools
    (``True`` = ``full``), in the given order.

    Raises:
        tetrad.spec.activation_checkpointing.CheckpointingError: an unknown name.
    """
    return tuple(dict.fromkeys(parse_checkpointing(c) for c in checkpointing))


def check_inputs(model: ModelSpec, gpus: int, global_batch: int, seq_len: int) -> None:
    """Check the question of both searches.

    Raises:
        PlanError: a non-positive GPU count, batch or sequence length, or a sequence longer than
            the model's learned positions.
    """
    for name, v in (("gpus", gpus), ("global batch", global_batch), ("sequence length", seq_len)):
        if int(v) != v or v < 1:
            raise PlanError(f"{name} {v} must be a positive integer")
    if model.max_positions and seq_len > model.max_positions:
        raise PlanError(
            f"--seq-len {seq_len} exceeds {model.name}'s {model.max_positions} "
            f"learned positions: use --seq-len <= {model.max_positions} or raise "
            "max_positions"
        )


def nearby_gpu_counts(model: ModelSpec, gpus: int) -> str:
    """The powers of two nearest ``gpus`` that have a grid sharding ``model`` with
    ``G_y G_x > 1`` possible (for error messages), nearest first."""
    found = []
    for e in range(0, 21):
        p = 2**e
        if any(not grid_problems(model, g) for g in factorizations(p, 4)):
            found.append(p)
    found.sort(key=lambda p: (abs(p - gpus), p))
    return ", ".join(str(f) for f in found[:2]) if found else "a power of two"
