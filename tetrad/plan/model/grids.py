"""Which grids shard a model: the sizes of a 4D (or 5D, with context) grid and the
divisibility rule of tetrad's layout. Plain Python."""

from __future__ import annotations

import functools
from collections.abc import Iterable

from tetrad.plan.errors import PlanError
from tetrad.plan.model.spec import ModelSpec


def context_size(grid: Iterable[int]) -> int:
    """``G_context`` of a five-size grid ``(G_data, G_context, G_z, G_y, G_x)``; 1 for four
    sizes ``(G_data, G_z, G_y, G_x)``."""
    grid = tuple(grid)
    return int(grid[1]) if len(grid) == 5 else 1


def with_context(grid: Iterable[int]) -> tuple[int, int, int, int, int]:
    """The five sizes of a four- or five-size grid (``G_context = 1`` for four)."""
    grid = tuple(int(g) for g in grid)
    return grid if len(grid) == 5 else (grid[0], 1, *grid[1:])  # type: ignore[return-value]


def grid_sizes(grid: Iterable[int]) -> tuple[int, int, int, int]:
    """``(G_data, G_z, G_y, G_x)`` as four positive integers, from those four or from
    ``(G_data, G_context, G_z, G_y, G_x)`` (:func:`context_size` reads ``G_context``).

    Raises:
        PlanError: not four positive integers.
    """
    grid = tuple(grid)
    try:
        return _grid_sizes(grid)
    except TypeError:  # an unhashable size: checked without the cache
        return _grid_sizes.__wrapped__(grid)


@functools.lru_cache(maxsize=1 << 14)
def _grid_sizes(grid: tuple) -> tuple[int, int, int, int]:
    """:func:`grid_sizes` of a tuple, checked once per grid (the memory model asks per term)."""
    if len(grid) == 5:
        grid = (grid[0], *grid[2:])
    try:
        gd, gz, gy, gx = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise PlanError(f"grid {grid!r} is not (G_data, G_z, G_y, G_x)") from None
    if min(gd, gz, gy, gx) < 1:
        raise PlanError(f"grid {grid!r} needs positive sizes G_data, G_z, G_y, G_x")
    return gd, gz, gy, gx


def grid_problems(model: ModelSpec, grid) -> list[str]:
    """Sizes of ``model`` that do not shard on ``grid = (G_data, G_z, G_y, G_x)``; empty if all do.

    Derived from tetrad's layout (tetrad/parallel: the runtime's rule too, through
    :func:`tetrad.models.config.check_divisible`): a non-transposed weight
    ``[n, k]`` needs ``n % (G_y G_z) == 0`` and ``k % G_x == 0``, a transposed one the same with X
    and Y swapped; heads and KV heads split over Y; the LM head (vocabulary over Y, X and Z) and
    so the embedding ``V % (G_y G_x G_z)``; norms ``h % G_x``. An MoE model's router and
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
    need(model.hidden % gx == 0, f"hidden={model.hidden} divisible by G_x={gx}")
    for lin in model.linears() + model.shared_linears():
        g_out, g_in, a_out, a_in = (
            (gx, gy, "G_x", "G_y") if lin.transposed else (gy, gx, "G_y", "G_x")
        )
        need(
            lin.out_features % (g_out * gz) == 0,
            f"{lin.name} out={lin.out_features} divisible by {a_out}*G_z={g_out * gz}",
        )
        need(
            lin.in_features % g_in == 0,
            f"{lin.name} in={lin.in_features} divisible by {a_in}={g_in}",
        )
    g_vocab = gy * gx * gz
    need(model.vocab % g_vocab == 0, f"vocab={model.vocab} divisible by G_y*G_x*G_z={g_vocab}")
    return tuple(bad)


def tp_problems(model: ModelSpec, tp: int) -> list[str]:
    """Sizes of ``model`` that Megatron-style tensor parallelism of degree ``tp`` cannot split
    (heads, KV heads, FFN width and hidden size over TP); empty if all divide."""
    sizes = (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("ffn_hidden", model.ffn_hidden),
        ("hidden", model.hidden),
    )
    return [f"{name}={v} divisible by TP={tp}" for name, v in sizes if v % tp]


def check_grid(model: ModelSpec, grid) -> None:
    """Raise :class:`PlanError` listing every size of ``model`` that does not shard on ``grid``."""
    bad = grid_problems(model, grid)
    if bad:
        raise PlanError(
            f"{model.name} does not shard on grid {tuple(grid)}: needs "
            + "; ".join(bad)
            + ": change the grid or the model sizes"
        )
