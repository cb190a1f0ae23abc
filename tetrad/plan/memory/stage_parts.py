"""The runtime model's parts of one pipeline stage, a model of ``k`` blocks
(:func:`stage_parts`, :func:`stage_saved`), and the tables a stage holds or drops
(:func:`table_elements`): what :mod:`tetrad.plan.memory.pipeline` adjusts per rank. Each is
memoised: the ranks of a pipeline, and the pipelines of a search, share them. Bytes and
elements; symbols as in :mod:`tetrad.plan.memory.runtime`."""

from __future__ import annotations

import dataclasses
import functools

from tetrad.plan.memory.activations import saved_activations
from tetrad.plan.memory.runtime import phase_components
from tetrad.spec.grid import grid_sizes
from tetrad.spec.model import ModelSpec


@functools.lru_cache(maxsize=1 << 12)
def stage_model(model: ModelSpec, blocks: int) -> ModelSpec:
    """``model`` with ``blocks`` blocks, one object per model and count (the memos keyed on it
    then hash it once and compare it by identity)."""
    return dataclasses.replace(model, n_layers=blocks)


def table_elements(model: ModelSpec, grid) -> tuple[int, int, int]:
    """``(embedding, LM head, final norm)`` local elements, as :mod:`tetrad.plan.memory.states`
    counts them (``n k / (G_x G_y G_z)`` per table, ``h / G_x`` for the norm)."""
    _, gz, gy, gx = grid_sizes(grid)
    shard = gx * gy * gz
    emb = model.vocab_size * model.dim // shard
    if model.max_positions:
        emb += model.max_positions * model.dim // shard
    head = model.vocab_size * model.dim // shard
    return emb, head, model.norm_params() // gx


@functools.lru_cache(maxsize=1 << 14)
def stage_parts(
    model: ModelSpec,
    blocks: int,
    grid: tuple,
    micro_batch: int,
    seq_len: int,
    ckpt: str,
    dtype: str,
    prefetch: bool,
    shard_optimizer: bool = False,
) -> tuple:
    """The runtime model's static components, phases and saved activations of a ``blocks``
    model (memoised: the ranks of a pipeline share them); ``shard_optimizer``: as
    :func:`tetrad.plan.memory.runtime.tetrad`'s.

    Raises:
        PlanError: a bad grid, a size that does not shard on it, or an unknown dtype.
    """
    sm = stage_model(model, blocks)
    opts = {"activation_checkpointing": ckpt, "dtype": dtype}
    static, phases = phase_components(
        sm, grid, micro_batch, seq_len, prefetch=prefetch, shard_optimizer=shard_optimizer, **opts
    )
    saved = saved_activations(sm, grid, micro_batch, seq_len, **opts)
    return static, phases, saved


@functools.lru_cache(maxsize=1 << 14)
def stage_saved(
    model: ModelSpec, blocks: int, grid: tuple, micro_batch: int, seq_len: int, ckpt, dtype
) -> dict[str, float]:
    """:func:`~tetrad.plan.memory.activations.saved_activations` of a ``blocks`` model (one
    stage), memoised."""
    sm = stage_model(model, blocks)
    return saved_activations(
        sm, grid, micro_batch, seq_len, activation_checkpointing=ckpt, dtype=dtype
    )
