"""Memory of the sharded optimizer (ZeRO-1, tetrad/parallel/zero.py): AdamW states split over the
``G = G_data G_context`` ranks of the data group, the reduced gradient pieces and the packed
buffers of its reduce-scatters and all-gathers. Bytes; symbols as in
:mod:`tetrad.plan.memory.runtime`.

Each parameter of ``n`` local elements keeps ``ceil(n / G)`` elements of each state: the model
counts ``n / G`` (exact when ``G`` divides every local shard, as on the grids the planner
searches; else below by at most ``G - 1`` elements per parameter).
"""

from __future__ import annotations

from tetrad.plan.errors import PlanError
from tetrad.plan.memory.states import (
    bias_elements,
    local_parameter_elements,
    optimizer_bytes_per_element,
    param_bytes,
)
from tetrad.spec.grid import context_size, grid_sizes
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import gather_groups
from tetrad.spec.units import FP32

SHARD_OPTIMIZER = ("auto", "on", "off")
"""The planner's choices for the sharded optimizer (``tetrad plan --shard-optimizer``)."""


def check_shard_optimizer(choice: str) -> None:
    """Raises :class:`~tetrad.plan.errors.PlanError` unless ``choice`` is one of
    :data:`SHARD_OPTIMIZER`."""
    if choice not in SHARD_OPTIMIZER:
        raise PlanError(f"shard_optimizer {choice!r} is unknown: use auto, on or off")


def state_bytes_per_element(sharded: bool, data_group: int, params: str = "fp32") -> float:
    """Bytes per local parameter element of the model states: fp32 parameter and gradient
    and two fp32 AdamW states, 16; with the states sharded over ``data_group`` ranks ``8 + 8 /
    data_group``. With bf16 weights (``params``): 2 + 4 + 12, the fp32 master with the states
    (``6 + 12 / data_group`` sharded: Megatron-LM's distributed optimizer, Fujii et al.'s
    ``2 + g + 12 / (d c)``)."""
    states = optimizer_bytes_per_element(params)
    return param_bytes(params) + FP32 + (states / data_group if sharded else states)


def data_group(grid) -> int:
    """``G_data G_context``: the ranks the sharded optimizer splits the states over."""
    return grid_sizes(grid)[0] * context_size(grid)


def expert_data_group(grid, expert: int) -> int:
    """An MoE model's expert-data group, the stage's ``G_data G_context G_z G_y G_x /
    G_expert`` ranks over which the sharded optimizer splits the routed experts' states
    (tetrad/parallel/zero.py ``DataShards.experts``, with ``G_data G_context > 1``); 1 without
    expert parallelism (the experts are then in the data group's share)."""
    if expert == 1:
        return 1
    gd, gz, gy, gx = grid_sizes(grid)
    return gd * context_size(grid) * gz * gy * gx // expert


def state_share(grid, shard_optimizer: bool) -> float:
    """The fraction of the AdamW states a rank keeps: ``1 / (G_data G_context)`` when sharded,
    else 1."""
    return 1.0 / data_group(grid) if shard_optimizer else 1.0


def end_of_backward_bytes(model: ModelSpec, grid, expert: int = 1) -> float:
    """Sharded, ``G > 1``: at the end of backward the reduced pieces ``4 n / G`` of all ``n``
    local elements. The packed copies that the reduce-scatters take
    (:meth:`tetrad.parallel.zero.DataShards.reduce_scatter`: during backward with
    ``dp_overlap``, in ``sync_gradients`` without) replace the gradients, which are dropped
    once packed, so they add nothing to the fp32 gradients counted already (the buckets take
    no gradient in place and ``sync_gradients`` makes no flat copy of the matrices)."""
    n = local_parameter_elements(model, grid, expert)  # expert-sharded weights: not here
    return FP32 * (n["matrices"] + n["vectors"]) / data_group(grid)


def unit_elements(model: ModelSpec, grid, expert: int = 1) -> dict[str, int]:
    """Local elements of each unit the sharded optimizer all-gathers after the update
    (tetrad/parallel/zero.py, ``gather_units``): ``embedding`` (the token table, with GPT's
    position table), ``block`` (the largest block: its Linears' shards ``n k / (G_x G_y G_z)``,
    its two norms and biases; an MoE block's router and, with ``expert = 1``, its experts;
    expert-sharded weights are not gathered over data), ``final_norm`` and ``head`` (0 when tied
    to the embedding). As :func:`tetrad.plan.memory.states.local_parameter_elements` counts
    them; they sum to its matrices and vectors (less expert-sharded experts)."""
    dense, moe = _block_elements(model, grid, expert)
    _, gz, gy, gx = grid_sizes(grid)
    shard = gx * gy * gz
    block = max(dense if model.dense_blocks else 0, moe if model.is_moe else 0)
    head = 0 if model.tied_embeddings else model.lm_head().weight_elements // shard
    emb = (model.vocab_size + model.max_positions) * model.dim // shard
    norm = model.norm_params() // gx
    return {"embedding": emb, "block": block, "final_norm": norm, "head": head}


def _block_elements(model: ModelSpec, grid, expert: int) -> tuple[int, int]:
    """Local elements of a dense block and of an MoE block (:func:`unit_elements`)."""
    _, gz, gy, gx = grid_sizes(grid)
    shard = gx * gy * gz
    norm = model.norm_params() // gx
    vectors = 2 * norm + sum(bias_elements(lin, gx, gy) for lin in model.linears())
    dense = sum(lin.count * (lin.weight_elements // shard) for lin in model.linears())
    moe = 0
    if model.is_moe:
        lins = model.attention_linears() + model.shared_linears()
        moe = sum(lin.count * (lin.weight_elements // shard) for lin in lins)
        moe += model.router_params() + (model.expert_params() if expert == 1 else 0)
    return dense + vectors, moe + vectors


def gather_group_elements(
    model: ModelSpec,
    grid,
    expert: int = 1,
    params: str = "fp32",
    first: bool = True,
    last: bool = True,
) -> list[float]:
    """Local elements of each all-gather after the update on a rank holding ``model``'s blocks,
    the embedding (``first``) and the final norm with the LM head (``last``): the units of
    :func:`unit_elements` in forward order, consecutive ones together until their bytes in the
    weights' format reach :data:`tetrad.spec.overlap.GATHER_GROUP_BYTES`
    (:func:`tetrad.spec.overlap.gather_groups`, as tetrad/parallel/zero.py cuts them)."""
    units = unit_elements(model, grid, expert)
    dense, moe = _block_elements(model, grid, expert)
    sizes = [units["embedding"]] if first else []
    sizes += [moe if model.moe_block(i) else dense for i in range(model.n_layers)]
    if last:
        sizes.append(units["final_norm"] + units["head"])
    p = param_bytes(params)
    return [sum(sizes[i] for i in run) for run in gather_groups([p * n for n in sizes])]


def gather_unit_bytes(elements: float, group: int, params: str = "fp32") -> float:
    """Bytes of one unit's all-gather after the update over ``group = G_data G_context`` ranks:
    its output ``[G, sum c]`` and this rank's packed row ``[sum c]`` in the weights' format,
    ``p n (1 + 1/G)`` (``c = n / G``)."""
    return param_bytes(params) * elements * (1 + 1 / group)


def step_bytes(
    model: ModelSpec,
    grid,
    dp_overlap: bool,
    expert: int = 1,
    params: str = "fp32",
    first: bool = True,
    last: bool = True,
) -> float:
    """Sharded, ``G > 1``: the optimizer step's largest temporary: the reduced pieces ``4 n /
    G``; the vectors' sum over Z (``G_z > 1``: a flat copy and its packed copy, their
    gradients dropped); and the first unit's all-gather after the update
    (:func:`gather_unit_bytes` of :func:`unit_elements`: the embedding, or on a pipeline
    rank without the first stage the first block; with the units after it while their bytes
    are below :data:`tetrad.spec.overlap.GATHER_GROUP_BYTES`: :func:`gather_group_elements`),
    the only one in flight: the next is issued
    when the next forward waits this one (tetrad/parallel/zero.py). ``first``, ``last``: the
    rank holds the embedding, the final norm and LM head (a pipeline stage's, ``model`` its
    blocks; ``n`` counts only the tables held). ``dp_overlap`` changes only how the
    reduce-scatters are cut.

    Not a phase of the model: the next forward, in which one unit's all-gather is in flight
    beside the micro-batch's activations (below the backward's peak, which holds the same
    activations and a block Linear's weight gradient at least as large)."""
    n = local_parameter_elements(model, grid, expert)  # expert-sharded weights: not here
    units = unit_elements(model, grid, expert)
    held = n["matrices"] + n["vectors"]
    held -= (0 if first else units["embedding"]) + (
        0 if last else units["head"] + units["final_norm"]
    )
    g = data_group(grid)
    gz = grid_sizes(grid)[1]
    vectors = 2 * n["vectors"] if gz > 1 else 0
    pieces = FP32 * held / g
    groups = gather_group_elements(model, grid, expert, params, first, last)
    gather = gather_unit_bytes(groups[0] if groups else 0.0, g, params)
    return pieces + max(FP32 * vectors, gather)
