"""What ``tetrad calibrate`` measures (plain Python): the GEMM shapes, copy size, attention
shape and collective payloads per device, quick or full (:func:`settings`), the collective kinds
(:data:`KINDS`) and the grid-like rank groups they run over (:func:`layouts`,
:func:`group_ranks`)."""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.plan.machine.network import ALL_GATHER, ALL_REDUCE
from tetrad.spec.units import GiB, KiB, MiB

KINDS = (ALL_REDUCE, ALL_GATHER)
"""The collectives measured. The gloo backend emulates reduce-scatter with an all-reduce, and the
planner sends every kind of collective through one bandwidth, so reduce-scatter is not measured
separately."""


@dataclass(frozen=True)
class Settings:
    """What to measure; :func:`settings` picks the quick or full set per device.

    Attributes:
        gemm_shapes: ``(m, n, k)`` of ``[m, k] @ [k, n]``.
        copy_bytes: bytes of the tensor copied for the memory bandwidth.
        attention: ``(batch, heads, seq_len, head_dim)`` of the attention measurement.
        payloads: collective payloads, bytes (rounded up to a multiple of ``4 * G``).
        min_time_s: each timed region lasts about this long (repeats are sized to it).
        trials: timed regions per measurement; the best is kept.
        max_iters: at most this many calls per timed region.
    """

    gemm_shapes: tuple[tuple[int, int, int], ...]
    copy_bytes: int
    attention: tuple[int, int, int, int]
    payloads: tuple[int, ...]
    min_time_s: float
    trials: int
    max_iters: int


def settings(device: str, quick: bool) -> Settings:
    """The measurement set for ``device`` (``cpu`` or ``cuda``); ``quick``: a few seconds."""
    kib, mib = KiB, MiB
    if device == "cuda":
        if quick:
            return Settings(
                ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 1024, 1024)),
                256 * mib,
                (2, 16, 1024, 128),
                (1 * kib, 1 * mib, 64 * mib),
                0.01,
                2,
                200,
            )
        squares = tuple((n, n, n) for n in (256, 512, 1024, 2048, 4096, 8192))
        skinny = (
            (8192, 1024, 1024),
            (16384, 4096, 1024),
            (16384, 1024, 4096),
            (4096, 14336, 4096),
            (4096, 4096, 14336),
            (8192, 16032, 4096),
            (2048, 512, 4096),
            (65536, 128, 128),
        )
        return Settings(
            squares + skinny,
            GiB,
            (4, 32, 2048, 128),
            (1 * kib, 16 * kib, 256 * kib, 4 * mib, 32 * mib, 128 * mib, 512 * mib),
            0.05,
            3,
            1000,
        )
    if quick:
        return Settings(
            ((128, 128, 128), (256, 256, 256), (1024, 128, 128), (2048, 256, 256)),
            8 * mib,
            (1, 4, 128, 32),
            (256, 64 * kib, 1 * mib),
            0.01,
            2,
            200,
        )
    squares = tuple((n, n, n) for n in (64, 128, 256, 512, 1024, 2048))
    skinny = (
        (1024, 256, 256),
        (1024, 768, 256),
        (1024, 256, 768),
        (4096, 256, 256),
        (4096, 4096, 256),
        (8192, 128, 128),
        (256, 2048, 2048),
        (4096, 64, 64),
    )
    return Settings(
        squares + skinny,
        64 * mib,
        (4, 8, 512, 32),
        (64, 1 * kib, 16 * kib, 128 * kib, 1 * mib, 4 * mib, 16 * mib),
        0.1,
        3,
        2000,
    )


def layouts(world: int) -> list[tuple[int, int]]:
    """``(stride, size)`` of every grid-axis group layout of ``world`` ranks: ``size > 1`` and
    ``stride * size`` dividing ``world`` (stride 1 first)."""
    return [
        (st, g)
        for g in range(2, world + 1)
        if world % g == 0
        for st in range(1, world // g + 1)
        if (world // g) % st == 0
    ]


def group_ranks(stride: int, size: int, world: int) -> list[list[int]]:
    """The groups ``{base + i * stride : i < size}`` that partition ``range(world)``."""
    block = stride * size
    return [
        [outer * block + i * stride + inner for i in range(size)]
        for outer in range(world // block)
        for inner in range(stride)
    ]
