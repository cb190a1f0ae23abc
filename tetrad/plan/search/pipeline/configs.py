"""What the pipeline search enumerates on top of a 5D grid (the package doc states the space):
the pipeline sizes ``G_pipe`` (:func:`pipe_sizes`), the checkpointing modes in their order
(:data:`MODE_ORDER`), the schedules of ``p`` ranks and ``m`` micro-batches (:func:`schedules`,
with the virtual stages of :data:`VIRTUAL_CHOICES`), and each configuration's place in
enumeration order (:func:`enumeration_order`), which breaks the top-K's ties in step time."""

from __future__ import annotations

import functools

from tetrad.plan.pipe.pipeline_step import PipeConfig
from tetrad.plan.pipe.schedule import SCHEDULES, schedule_problems
from tetrad.plan.search.space import divisors_of
from tetrad.spec.grid import ORIENTATIONS, role_sizes

MODE_ORDER = ("none", "selective", "full")
"""The checkpointing modes in the pipeline search's order: a mode is tried only where no
cheaper one fits."""
VIRTUAL_CHOICES = (2, 3, 4, 5, 6, 8)
"""Virtual stages per rank tried with ``interleaved-1f1b`` (NVIDIA's Llama-3 recipes use 5 and
8, torchtitan 2 by default)."""


def pipe_sizes(gpus: int, n_layers: int) -> list[int]:
    """The ``G_pipe`` tried on ``gpus`` GPUs: the divisors of ``gpus`` from 2 to the blocks."""
    return [p for p in divisors_of(gpus) if 2 <= p <= n_layers]


@functools.lru_cache(maxsize=1 << 12)
def schedules(pipe: int, m: int, n_layers: int) -> tuple[PipeConfig, ...]:
    """The schedules of ``p = pipe`` ranks and ``m`` micro-batches on ``n_layers`` blocks, in
    enumeration order: ``1f1b`` where ``m >= p`` (GPipe has the same bubble on equal ranks and
    more memory, so it is tried only where 1F1B cannot run), then ``interleaved-1f1b`` with each
    ``v`` of :data:`VIRTUAL_CHOICES` that the schedule accepts (``p v <= L``, ``m % p == 0``:
    :func:`tetrad.plan.pipe.schedule.schedule_problems`). Memoised: a pure function of the
    three counts."""
    out = []
    if not schedule_problems("1f1b", pipe, 1, m):
        out.append(PipeConfig(pipe, 1, "1f1b"))
    else:
        out.append(PipeConfig(pipe, 1, "gpipe"))
    for v in VIRTUAL_CHOICES:
        if pipe * v <= n_layers and not schedule_problems("interleaved-1f1b", pipe, v, m):
            out.append(PipeConfig(pipe, v, "interleaved-1f1b"))
    return tuple(out)


def enumeration_order(grid, turn: str, b: int, mode: str, cfg: PipeConfig, zero: bool) -> int:
    """The place of a pipeline configuration in enumeration order, a number (the top-K's ties
    go to the lower): ``G_pipe``, schedule, virtual stages, the roles' sizes, orientation
    (``xy`` first), micro-batch, checkpointing mode, optimizer variant, each in ascending
    order."""
    roles = role_sizes(grid, turn)
    fields = (
        (cfg.pipe, 16),
        (SCHEDULES.index(cfg.schedule), 2),
        (cfg.virtual, 8),
        *((size, 32) for size in roles),
        (ORIENTATIONS.index(turn), 1),
        (b, 32),
        (MODE_ORDER.index(mode), 2),
        (int(zero), 1),
    )
    out = 0
    for value, bits in fields:
        out = (out << bits) | value
    return out
