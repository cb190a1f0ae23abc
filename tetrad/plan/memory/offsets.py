"""How much the sharded optimizer moves each phase of :func:`tetrad.plan.memory.runtime.tetrad`
(:func:`sharding_offsets`): what lets the search derive a grid's sharded memory line from its
unsharded one. Bytes."""

from __future__ import annotations

import functools

from tetrad.plan.memory.grid_buffers import grid_buffers
from tetrad.plan.memory.runtime import PHASES
from tetrad.spec.model import ModelSpec


@functools.lru_cache(maxsize=1 << 13)
def sharding_offsets(model: ModelSpec, grid: tuple, dtype: str, prefetch: bool) -> dict:
    """Per phase of :func:`tetrad` (default overlaps): the bytes the sharded optimizer adds
    (negative: saves) to the unsharded total, the same for every micro-batch and checkpointing
    mode: the AdamW states in every phase, the end of backward's and the step's buffers in
    theirs (:mod:`tetrad.plan.memory.zero`)."""
    plain = grid_buffers(model, grid, dtype, prefetch, True, True, False)
    zero = grid_buffers(model, grid, dtype, prefetch, True, True, True)
    static = sum(v for _, v in zero.static) - sum(v for _, v in plain.static)
    out = dict.fromkeys(PHASES, static)
    out["backward: end"] += zero.end_of_backward - plain.end_of_backward
    out["optimizer step"] += zero.step - plain.step
    return out
