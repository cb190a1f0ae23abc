"""Model states of one rank of tetrad's runtime, exact: its parameter shards (fp32, or bf16 with
``--param-dtype bf16``), their gradients (fp32) and AdamW's two states (and the fp32 masters of
bf16 weights), from tetrad's 3D layout (tetrad/parallel/{linear,embedding,norm}.py). Bytes;
symbols as in :mod:`tetrad.plan.memory.runtime`."""

from __future__ import annotations

import functools

from tetrad.plan.errors import PlanError
from tetrad.spec.grid import grid_sizes
from tetrad.spec.model import Linear, ModelSpec
from tetrad.spec.precision import DTYPE_BYTES, PARAM_DTYPES
from tetrad.spec.sharding import check_grid
from tetrad.spec.units import FP32


def param_bytes(params: str) -> int:
    """Bytes per element of weights stored in ``params`` (``fp32`` or ``bf16``,
    :data:`tetrad.spec.precision.PARAM_DTYPES`).

    Raises:
        PlanError: another format.
    """
    if params not in PARAM_DTYPES:
        raise PlanError(f"param dtype {params!r} is unknown: use {' or '.join(PARAM_DTYPES)}")
    return DTYPE_BYTES[params]


def optimizer_bytes_per_element(params: str) -> int:
    """AdamW's bytes per parameter element: ``exp_avg`` and ``exp_avg_sq`` in fp32, 8; with
    weights stored in bf16 also the fp32 master the optimizer updates, 12 (Megatron-LM's
    mixed precision: Narayanan et al., arXiv 2104.04473; Fujii et al.'s ``12`` bytes,
    ``/work/shared/notes/memory-estimation.md`` section 4)."""
    return 2 * FP32 + (FP32 if param_bytes(params) != FP32 else 0)


def bias_elements(lin: Linear, gx: int, gy: int) -> int:
    """Local bias elements ``n / G_out`` (replicated over the input axis, Z and data)."""
    if not lin.bias:
        return 0
    return lin.count * lin.out_features // (gx if lin.transposed else gy)


def local_parameter_elements(model: ModelSpec, grid, expert: int = 1) -> dict[str, int]:
    """Elements of this rank's parameter shards, by kind; the same on every rank.

    Derived from tetrad's layout (tetrad/parallel/{linear,embedding,norm,model,experts}.py):
    every Linear and Embedding weight ``[n, k]`` is stored as ``n k / (G_x G_y G_z)`` elements
    whatever its orientation; biases ``n/G_y`` (``n/G_x`` when transposed); norm weights
    ``h/G_x`` (GPT LayerNorm: weight and bias, ``2h/G_x``), replicated over Y, Z and data. An
    MoE block's router ``[E, h]`` is whole on every rank; its routed experts ``3 E h f_e`` too
    when ``expert = 1``, else split over the ``expert = G_expert`` ranks of an expert group:
    ``3 (E / G_expert) h f_e``, ``E / G_expert`` experts whole per rank, never replicated within
    the group (MoE Parallel Folding with ``ETP = 1``, Liu et al., arXiv 2504.14960: the expert
    axis folds over all ``G_data G_context G_z G_y G_x`` ranks of a pipeline stage, innermost
    first, so an expert group may span Z, Y and X ranks; the count does not depend on which).

    Returns:
        ``{"matrices": ..., "vectors": ..., "experts": ...}``: elements of the Z-sharded 2-D
        shards (summed over data in the data-parallel buckets), of the weights replicated
        over Z and data (norm weights, biases, routers, and the experts when ``expert = 1``:
        the runtime's ``late`` gradients, summed over Z and data after backward) and of the
        expert-sharded weights (``expert > 1``: summed over the expert-data group only, the
        stage's ranks over ``G_expert``, never in the buckets, their AdamW states never
        sharded). ``experts`` is 0 for a dense model.

    Raises:
        PlanError: a bad grid, or a size that does not shard on it.
    """
    matrices, vectors, experts = _checked_elements(model, tuple(grid), expert)
    return {"matrices": matrices, "vectors": vectors, "experts": experts}


@functools.lru_cache(maxsize=4096)
def _checked_elements(
    model: ModelSpec, grid: tuple[int, ...], expert: int = 1
) -> tuple[int, int, int]:
    """``(matrices, vectors, experts)`` of :func:`local_parameter_elements`, the grid checked
    once per model, grid and expert axis."""
    _, gz, gy, gx = grid_sizes(grid)
    check_grid(model, grid)
    matrices, vectors = _local_elements(model, gz, gy, gx)
    if not model.is_moe:
        return matrices, vectors, 0
    if model.n_experts % expert:
        raise PlanError(
            f"expert parallelism {expert} does not divide n_experts={model.n_experts}: "
            "choose a divisor"
        )
    routed = model.moe_layers * model.expert_params()
    router = model.moe_layers * model.router_params()
    matrices -= routed + router  # _local_elements counts them whole with the Linears
    if expert == 1:
        return matrices, vectors + router + routed, 0
    return matrices, vectors + router, routed // expert


@functools.lru_cache(maxsize=4096)
def _local_elements(model: ModelSpec, gz: int, gy: int, gx: int) -> tuple[int, int]:
    """``(matrices, vectors)`` of :func:`local_parameter_elements`, once per model and
    ``(G_z, G_y, G_x)`` (the shards do not depend on ``G_data`` or ``G_context``; the grid is
    checked by the caller)."""
    shard = gx * gy * gz
    block = [lin.weight_elements // shard for lin in model.linears() for _ in range(lin.count)]
    moe = _moe_matrix_elements(model, shard)
    tables = [model.vocab_size * model.dim // shard]
    if model.max_positions:
        tables.append(model.max_positions * model.dim // shard)
    if not model.tied_embeddings:
        tables.append(model.lm_head().weight_elements // shard)
    matrices = model.dense_blocks * sum(block) + moe + sum(tables)
    norm = model.norm_params() // gx
    bias = sum(bias_elements(lin, gx, gy) for lin in model.linears())
    vectors = model.n_layers * (2 * norm + bias) + norm
    return matrices, vectors


def _moe_matrix_elements(model: ModelSpec, shard: int) -> int:
    """Matrix elements of the MoE blocks on one rank: attention and shared-expert Linears
    sharded as every Linear (``/ (G_x G_y G_z)``), router ``E h`` and experts ``3 E h f_e``
    whole (:func:`_checked_elements` moves these two to their kinds and splits the experts
    over the expert axis)."""
    if not model.is_moe:
        return 0
    lins = model.attention_linears() + model.shared_linears()
    sharded = sum(lin.count * (lin.weight_elements // shard) for lin in lins)
    return model.moe_layers * (sharded + model.router_params() + model.expert_params())


def _all_elements(model: ModelSpec, grid, expert: int) -> int:
    n = local_parameter_elements(model, grid, expert)
    return n["matrices"] + n["vectors"] + n["experts"]


def tetrad_parameter_bytes(model: ModelSpec, grid, expert: int = 1, params: str = "fp32") -> float:
    """The weights of this rank's shards as stored: ``4`` (fp32; bf16 autocast casts them per
    GEMM) or ``2`` (``params="bf16"``) bytes per local element; ``expert``: ``G_expert``.

    Raises:
        PlanError: an unknown ``params``, a bad grid or a size that does not shard on it.
    """
    return float(param_bytes(params) * _all_elements(model, grid, expert))


def tetrad_gradient_bytes(model: ModelSpec, grid, expert: int = 1) -> float:
    """fp32 gradient of every local shard (``.grad``, or the fp32 one kept apart from bf16
    weights: tetrad/parallel/masters.py). Counted for the whole step (conservative when a step
    has one micro-batch: then they appear during backward)."""
    return float(FP32 * _all_elements(model, grid, expert))


def tetrad_optimizer_bytes(model: ModelSpec, grid, expert: int = 1, params: str = "fp32") -> float:
    """AdamW ``exp_avg`` and ``exp_avg_sq``: two fp32 copies of every local shard
    (torch.optim.AdamW built by tetrad.train.step.build_optimizer), and with bf16 weights the
    fp32 master (:func:`optimizer_bytes_per_element`). The per-parameter ``step`` counters are
    not counted: 0-d fp32 tensors, 4 bytes per parameter tensor (on its device with the fused
    kernel)."""
    return float(optimizer_bytes_per_element(params) * _all_elements(model, grid, expert))
