"""Which grids shard a model: the divisibility rule of tetrad's layout (the runtime's and the
planner's), and the grids the mixture-of-experts runtime supports. Plain Python."""

from __future__ import annotations

import functools

from tetrad.spec.grid import GridError, GridShape, with_context
from tetrad.spec.model import ModelSpec


def grid_problems(model: ModelSpec, grid) -> list[str]:
    """Sizes of ``model`` that do not shard on ``grid = (G_data, G_z, G_y, G_x)``; empty if all do.

    Derived from tetrad's layout (tetrad/parallel: the runtime's rule too): a non-transposed weight
    ``[n, k]`` needs ``n % (G_y G_z) == 0`` (each stacked matrix's ``n / stacked`` rows, for
    ``w13``) and ``k % G_x == 0``, a transposed one the same with X and Y swapped; heads and KV
    heads split over Y; the LM head (vocabulary over Y, X and Z) and so the embedding
    ``V % (G_y G_x G_z)``; norms ``h % G_x``. An MoE model's router and
    experts split no further (whole on every tensor rank, which routes its own slice of the
    tokens: :mod:`tetrad.parallel.moe_tensor`).
    ``grid``: four sizes or five (with ``G_context``, which splits no weight).
    """
    return list(_grid_problems(model, *(int(g) for g in tuple(grid)[-3:])))


@functools.lru_cache(maxsize=4096)
def _grid_problems(model: ModelSpec, gz: int, gy: int, gx: int) -> tuple[str, ...]:
    """:func:`grid_problems`, once per model and ``(G_z, G_y, G_x)``."""
    bad: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok and msg not in bad:
            bad.append(msg)

    need(model.n_heads % gy == 0, f"n_heads={model.n_heads} divisible by G_y={gy}")
    need(model.n_kv_heads % gy == 0, f"n_kv_heads={model.n_kv_heads} divisible by G_y={gy}")
    need(model.dim % gx == 0, f"dim={model.dim} divisible by G_x={gx}")
    for lin in model.linears() + model.shared_linears():
        g_out, g_in, a_out, a_in = (
            (gx, gy, "G_x", "G_y") if lin.transposed else (gy, gx, "G_y", "G_x")
        )
        rows = lin.out_features // lin.stacked  # of each stacked matrix (w13: gate, up)
        need(
            rows % (g_out * gz) == 0,
            f"{lin.name} out={rows} (per stacked matrix) divisible by {a_out}*G_z={g_out * gz}"
            if lin.stacked > 1
            else f"{lin.name} out={lin.out_features} divisible by {a_out}*G_z={g_out * gz}",
        )
        need(
            lin.in_features % g_in == 0,
            f"{lin.name} in={lin.in_features} divisible by {a_in}={g_in}",
        )
    g_vocab = gy * gx * gz
    need(
        model.vocab_size % g_vocab == 0,
        f"vocab_size={model.vocab_size} divisible by G_y*G_x*G_z={g_vocab}",
    )
    return tuple(bad)


def tp_problems(model: ModelSpec, tp: int) -> list[str]:
    """Sizes of ``model`` that Megatron-style tensor parallelism of degree ``tp`` cannot split
    (heads, KV heads, FFN width and hidden size over TP); empty if all divide."""
    sizes = (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("ffn_dim", model.ffn_dim),
        ("dim", model.dim),
    )
    return [f"{name}={v} divisible by TP={tp}" for name, v in sizes if v % tp]


def check_grid(model: ModelSpec, grid) -> None:
    """Check that every weight of ``model`` shards on ``grid`` (:func:`grid_problems`).

    Raises:
        GridError: one line listing every size that does not divide, and what to change.
    """
    bad = grid_problems(model, grid)
    if bad:
        raise GridError(
            f"{model.name} does not shard on grid {tuple(grid)}: needs "
            + "; ".join(bad)
            + ": change the grid or the model sizes"
        )


def moe_grid_problem(
    cfg: ModelSpec, grid: GridShape, pipe: int = 1, expert: int = 1, seq_len: int | None = None
) -> str | None:
    """Why the MoE runtime cannot run ``cfg`` on ``grid = (G_data, G_context, G_z, G_y, G_x)``
    with ``pipe`` stages, expert parallelism ``expert`` and sequences of ``seq_len`` tokens
    (None: not checked), in one line that names what to use instead; None when it can (and for
    every dense model without expert parallelism).

    The router is replicated on every rank; the experts too, or split over ``G_expert``
    consecutive ranks of a stage (:data:`tetrad.spec.grid.EXPERT_GRID_AXES`). MoE models run
    on every axis: on Y and X each tensor rank routes its own slice of the tokens
    (:mod:`tetrad.parallel.moe_tensor`; the sequence positions per rank must divide by
    ``G_y G_x``).
    """
    data, context, z, y, x = (int(g) for g in with_context(grid))
    if not cfg.is_moe:
        if expert > 1:
            return f"expert parallelism {expert} needs a model with experts: drop --expert-parallel"
        return None
    if seq_len is not None and seq_len % (context * y * x):
        return (
            f"MoE on G_y*G_x={y * x} tensor ranks splits each rank's {seq_len}/G_context "
            f"positions {y * x} ways: use a seq_len divisible by G_context*G_y*G_x="
            f"{context * y * x}"
        )
    stage = data * context * z * y * x
    if expert > 1 and (cfg.n_experts % expert or stage % expert):
        return (
            f"expert parallelism {expert} must divide n_experts={cfg.n_experts} and the "
            f"{stage} ranks of a pipeline stage: change --expert-parallel"
        )
    return None


def check_moe_grid(
    model: ModelSpec, grid: GridShape, pipe: int = 1, expert: int = 1, seq_len: int | None = None
) -> None:
    """Refuse a grid the MoE runtime does not support yet (:func:`moe_grid_problem`).

    Raises:
        GridError: one line naming the grid to use instead.
    """
    problem = moe_grid_problem(model, grid, pipe, expert, seq_len)
    if problem:
        raise GridError(problem)


def context_problems(seq_len: int, gc: int) -> list[str]:
    """Why ``seq_len`` cannot be split over ``G_context = gc`` ranks (empty when it can): each
    rank holds two of ``2 G_context`` equal chunks (causal attention's work balanced)."""
    if gc > 1 and seq_len % (2 * gc):
        return [f"seq_len {seq_len} % (2*G_context = {2 * gc}) == 0"]
    return []


def sequence_parallel_problem(
    model: ModelSpec, grid: GridShape, seq_len: int | None = None
) -> str | None:
    """Why sequence parallelism (the residual stream split along the sequence over Y,
    :mod:`tetrad.parallel.sequence`) cannot run ``model`` on ``grid = (G_data, [G_context,]
    G_z, G_y, G_x)`` in roles with sequences of ``seq_len`` tokens (None: not checked), in one
    line that names what to change; None when it can.

    It needs a tensor axis in the Y role (``G_y > 1``; with ``G_x = 1`` Megatron-LM's layout,
    a lone tensor axis getting the Y role under the default orientation; with ``G_x > 1`` the
    stream ``[b, S/G_y, h/G_x]`` split over both), a dense model, and each rank's
    ``seq_len / G_context`` tokens divisible by ``G_y``.
    """
    _, context, _, y, x = (int(g) for g in with_context(grid))
    if y == 1:
        return (
            f"sequence parallelism splits the sequence over the tensor axis in the Y role, and "
            f"G_y=1 (G_x={x}): use a grid with a tensor axis (y=N, or x=N with orientation "
            "auto) or drop --sequence-parallel"
        )
    if model.is_moe:
        return "sequence parallelism is not built for MoE models yet: drop --sequence-parallel"
    if seq_len is not None and seq_len % (context * y):
        return (
            f"sequence parallelism splits each rank's seq_len/G_context tokens over G_y={y}: "
            f"use a seq_len divisible by G_context*G_y={context * y}"
        )
    return None
