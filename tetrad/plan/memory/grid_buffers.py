"""The bytes of :func:`tetrad.plan.memory.runtime.runtime_memory` that depend on the grid and the
options but not on the micro-batch or the checkpointing mode (:class:`GridBuffers`), once per
grid and options: the search asks for several micro-batches and modes of each grid, tens of
thousands of times in all. Bytes; symbols as in :mod:`tetrad.plan.memory.runtime`."""

from __future__ import annotations

import functools
from typing import NamedTuple

from tetrad.plan.memory import sharded_optimizer
from tetrad.plan.memory.buffers import (
    embedding_grad_bytes,
    end_of_backward_bytes,
    expert_gradient_bytes,
    gathered_weight_bytes,
    step_buffer_bytes,
    weight_gradient_bytes,
)
from tetrad.plan.memory.formats import dtype_bytes
from tetrad.plan.memory.states import (
    local_parameter_elements,
    optimizer_bytes_per_element,
    param_bytes,
    tetrad_gradient_bytes,
    tetrad_optimizer_bytes,
    tetrad_parameter_bytes,
)
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import Linear, ModelSpec
from tetrad.spec.overlap import REDUCE_SCATTERS_IN_FLIGHT
from tetrad.spec.sharding import check_grid
from tetrad.spec.units import FP32


class GridBuffers(NamedTuple):
    """The bytes of :func:`tetrad.plan.memory.runtime.runtime_memory` that depend on the grid and
    the options but not on the micro-batch or the checkpointing mode.

    Attributes:
        static: ``(name, bytes)`` of the parameters, gradients and optimizer states.
        base: their sum, ``sum(v for _, v in static)`` (every phase's total starts there).
        head_forward: gathered weights inside the LM head's forward (its ``W``, with
            ``prefetch`` the next two block weights); ``head_backward``: in its backward.
        head_gradient: the fp32 copy of the head's ``dW`` (compute dtype bf16).
        blocks: gathered weights in the blocks' backward; ``block_gradients``: their ``dW``.
        end_of_backward: :func:`~tetrad.plan.memory.buffers.end_of_backward_bytes` (sharded:
            the embedding's gradient block and :func:`tetrad.plan.memory.sharded_optimizer.
            end_of_backward_bytes`) + ``end_prefetch``; ``step``:
            :func:`~tetrad.plan.memory.buffers.step_buffer_bytes` (sharded:
            :func:`tetrad.plan.memory.sharded_optimizer.step_bytes`).
        end_prefetch: with ``prefetch`` and ``G_z > 1`` the next micro-batch's embedding table
            and first block weight, gathered ahead at the end of backward; else 0.
        shape: ``(1, G_context, 1, G_y, G_x)``, the sizes the saved activations depend on (the
            key of :func:`tetrad.plan.memory.activations.saved_activations`' memo).
    """

    static: tuple[tuple[str, float], ...]
    base: float
    head_forward: float
    head_backward: float
    head_gradient: float
    blocks: float
    block_gradients: float
    end_of_backward: float
    step: float
    end_prefetch: float
    shape: tuple[int, int, int, int, int]


@functools.lru_cache(maxsize=1 << 14)
def checked_grid_buffers(
    model: ModelSpec,
    grid: tuple,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    shard_optimizer: bool = False,
    expert: int = 1,
    params: str = "fp32",
) -> GridBuffers:
    """:func:`grid_buffers` after checking the dtype and that ``model`` shards on ``grid``, in
    :func:`tetrad.plan.memory.runtime.runtime_memory`'s order; once per grid and options (an error
    is not memoised: it is raised again on every call).

    Raises:
        PlanError: an unknown dtype or param dtype, a bad grid, a size that does not shard on
            it, or an expert axis that does not divide the experts.
    """
    dtype_bytes(dtype)
    param_bytes(params)
    check_grid(model, grid)
    options = (dtype, prefetch, async_reduce_scatter, dp_overlap, shard_optimizer)
    if expert == 1 and params == "fp32":  # what every dense caller gives (one memo entry)
        return grid_buffers(model, grid, *options)
    local_parameter_elements(model, grid, expert)  # checks the expert axis
    return grid_buffers(model, grid, *options, expert, params)


@functools.lru_cache(maxsize=256)
def _largest_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """The three largest block Linears of ``model`` by weight elements, largest first (a
    stable sort: ties keep the execution order), once per model. An MoE model's Z-sharded
    Linears are its attention's, its shared expert's and, when it has dense blocks, their
    FFN's (its routed experts are not gathered over Z)."""
    lins = model.linears()
    if model.is_moe:
        ffn = lins if model.dense_blocks else model.attention_linears()
        lins = list(ffn) + model.shared_linears()
    by_size = sorted(lins, key=lambda lin: lin.weight_elements, reverse=True)
    return tuple(by_size[:3])


@functools.lru_cache(maxsize=256)
def _lm_head(model: ModelSpec) -> Linear:
    """``model.lm_head()``, once per model."""
    return model.lm_head()


@functools.lru_cache(maxsize=1 << 14)
def grid_buffers(
    model: ModelSpec,
    grid: tuple,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    shard_optimizer: bool = False,
    expert: int = 1,
    params: str = "fp32",
) -> GridBuffers:
    """:class:`GridBuffers` of ``grid = (G_data, G_z, G_y, G_x)`` or ``(G_data, G_context,
    G_z, G_y, G_x)`` and the options of :func:`tetrad.plan.memory.runtime.runtime_memory`, once per
    grid and options (the grid is not checked: :func:`checked_grid_buffers` does). Only the
    end of backward's data-parallel buffers depend on ``G_data G_context``: the rest is taken
    from the grid ``(1, G_z, G_y, G_x)``, once per ``(G_z, G_y, G_x)``. The sharded optimizer
    (``G_data G_context > 1``) changes only the AdamW states, the end of backward's and the
    step's buffers: the rest is the unsharded grid's.

    ``expert``: ``G_expert`` of an MoE model (:func:`tetrad.plan.memory.states.
    local_parameter_elements`); its grids are computed whole, not from ``(1, G_z, G_y, G_x)``.
    ``params``: the weights' stored format (``fp32``, or ``bf16`` with fp32 masters in the
    AdamW states; :mod:`tetrad.plan.memory.states`).

    Raises:
        PlanError: not four or five positive sizes, or an unknown dtype.
    """
    _, gz, gy, gx = grid_sizes(grid)
    group = sharded_optimizer.data_group(grid)
    overlaps = (prefetch, async_reduce_scatter)
    if model.n_experts:
        plain = _unsharded(model, grid, dtype, *overlaps, dp_overlap, expert, params)
        if shard_optimizer:
            return _sharded(model, grid, plain, dp_overlap, expert, params)
        return plain
    if shard_optimizer and group > 1:
        plain = grid_buffers(model, grid, dtype, *overlaps, dp_overlap, False, 1, params)
        return _sharded(model, grid, plain, dp_overlap, 1, params)
    if group > 1:  # as on (1, G_z, G_y, G_x) but for the data-parallel buffers
        one = grid_buffers(model, (1, gz, gy, gx), dtype, *overlaps, True, False, 1, params)
        return one._replace(
            end_of_backward=end_of_backward_bytes(model, grid, dp_overlap) + one.end_prefetch,
            shape=(1, context_size(grid), 1, gy, gx),
        )
    return _unsharded(model, grid, dtype, *overlaps, dp_overlap, 1, params)


def _unsharded(
    model: ModelSpec,
    grid: tuple,
    dtype: str,
    prefetch: bool,
    async_reduce_scatter: bool,
    dp_overlap: bool,
    expert: int = 1,
    params: str = "fp32",
) -> GridBuffers:
    """:func:`grid_buffers` with the optimizer not sharded."""
    gz, gy, gx = grid_sizes(grid)[1:]
    e = dtype_bytes(dtype)
    vy = model.vocab_size // (gy * gx)  # logits per rank: V over Y and X
    largest = _largest_linears(model)
    big = largest[0]
    w_head = gathered_weight_bytes(_lm_head(model), grid, dtype, params)
    w_largest = [gathered_weight_bytes(lin, grid, dtype, params) for lin in largest]
    w_big = w_largest[0]
    w_two = sum(w_largest[:2])
    w_three = sum(w_largest[:3])
    # the next micro-batch's table and first block weight, prefetched at the end of backward
    # (counted whatever the micro-batches per step: the model does not know them)
    wrap = e * model.vocab_size * model.dim // (gx * gy) + w_big if prefetch and gz > 1 else 0.0
    dw_blocks = weight_gradient_bytes(big, grid, dtype) * (
        1 + REDUCE_SCATTERS_IN_FLIGHT if async_reduce_scatter and gz > 1 else 1
    )
    if model.is_moe:  # an expert weight's gradient [E/G_expert, f_e, h] before its .grad
        dw_blocks = max(dw_blocks, expert_gradient_bytes(model, dtype, expert))
    static = (
        ("parameters", tetrad_parameter_bytes(model, grid, expert, params)),
        ("gradients", tetrad_gradient_bytes(model, grid, expert)),
        ("optimizer_states", tetrad_optimizer_bytes(model, grid, expert, params)),
    )
    return GridBuffers(
        static=static,
        base=sum(v for _, v in static),
        head_forward=w_head + (w_two if prefetch else 0.0),
        head_backward=w_two if prefetch else 0.0,
        head_gradient=FP32 * vy * model.dim if e != FP32 else 0.0,
        blocks=w_three if prefetch else w_big,
        block_gradients=dw_blocks,
        end_of_backward=end_of_backward_bytes(model, grid, dp_overlap, expert) + wrap,
        step=step_buffer_bytes(model, grid, expert, dp_overlap),
        end_prefetch=wrap,
        shape=(1, context_size(grid), 1, gy, gx),
    )


def _sharded(
    model: ModelSpec,
    grid: tuple,
    plain: GridBuffers,
    dp_overlap: bool,
    expert: int = 1,
    params: str = "fp32",
) -> GridBuffers:
    """:func:`grid_buffers` with the optimizer sharded over ``G_data G_context > 1`` ranks,
    from the unsharded ``plain``: the AdamW states' (and bf16 weights' fp32 masters') share
    and the buffers of
    :mod:`tetrad.plan.memory.sharded_optimizer`. Expert-sharded weights (``expert > 1``) are
    summed over expert-data, not data: their states (and masters) are split over it
    (:func:`tetrad.plan.memory.sharded_optimizer.expert_data_group`; whole with one rank:
    tetrad/parallel/zero.py, ``DataShards.experts``); the step holds the packed copy of their
    reduce-scatter (as large as the flat sum it replaces) and then their reduced pieces ``4
    n_e / G_ed`` beside the data pieces until the update (counted together, above the
    pieces' all-gathers after it, which are smaller than the packed copy)."""
    if model.n_experts and sharded_optimizer.data_group(grid) == 1:
        return plain  # an MoE model comes here whatever the data group
    if expert > 1:
        n = local_parameter_elements(model, grid, expert)
        share = sharded_optimizer.state_share(grid, True)
        per = optimizer_bytes_per_element(params)
        edp = sharded_optimizer.expert_data_group(grid, expert)
        states = float(per * ((n["matrices"] + n["vectors"]) * share + n["experts"] / edp))
    else:
        share = sharded_optimizer.state_share(grid, True)
        states = tetrad_optimizer_bytes(model, grid, 1, params) * share
    static = (*plain.static[:2], ("optimizer_states", states))
    end = embedding_grad_bytes(model, grid)
    end += sharded_optimizer.end_of_backward_bytes(model, grid, expert)
    step = sharded_optimizer.step_bytes(model, grid, dp_overlap, expert, params)
    if expert > 1:
        step = max(step, step_buffer_bytes(model, grid, expert, dp_overlap))
        edp = sharded_optimizer.expert_data_group(grid, expert)
        if edp > 1:  # the experts' reduced pieces, held with the data's through the update
            step += FP32 * local_parameter_elements(model, grid, expert)["experts"] / edp
    return plain._replace(
        static=static,
        base=sum(v for _, v in static),
        end_of_backward=end + plain.end_prefetch,
        step=step,
    )
