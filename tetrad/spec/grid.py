"""The grid's axes and shapes, defined once for the runtime and the planner (plain Python).

- the axes of the grid and the groups collectives run over (:class:`Axis`);
- grid shapes ``(G_data, G_context, G_z, G_y, G_x)`` and the pipeline axis: parsing, the
  orientation of the X and Y roles, the world-size check, the expert axis folded over data x
  context.

Which grids shard a given model is :mod:`tetrad.spec.sharding`.
"""

from __future__ import annotations

import difflib
import enum
import functools
import math
from collections.abc import Iterable
from typing import NoReturn

from tetrad.spec.errors import TetradError


class Axis(str, enum.Enum):
    """A group of ranks a collective runs over: one axis of the grid, or the whole world.

    A ``str`` (``Axis.X == "x"``), so it names DeviceMesh dimensions and JSON keys as is.
    As a group of collectives, ``DATA`` is every rank that holds the same parameter shards and
    sees other tokens outside Z: ``G_data G_context`` ranks (Megatron-LM's data-parallel group
    with context parallelism), over which gradients and losses are summed; ``CONTEXT`` is the
    ``G_context`` ranks holding the chunks of the same sequences (the K/V all-gather).
    ``EXPERT`` (expert parallelism, folded over the ranks of a pipeline stage: no ranks of its
    own) is the ``G_expert`` ranks that split the routed experts and exchange tokens
    (all-to-all); ``EXPERT_DATA`` the other ``G_data G_context G_z G_y G_x / G_expert`` ranks
    of the stage holding the same experts, over which expert gradients are summed
    (Megatron-Core's expert-data-parallel group).
    """

    PIPE = "pipe"
    DATA = "data"
    CONTEXT = "context"
    Z = "z"
    Y = "y"
    X = "x"
    EXPERT = "expert"
    EXPERT_DATA = "expert_data"
    WORLD = "world"

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


GRID_AXES = (Axis.DATA, Axis.CONTEXT, Axis.Z, Axis.Y, Axis.X)
"""The grid's axes, outer to inner: the DeviceMesh dimension order and AxoNN's rank order
(Singh et al., arXiv 2305.13525) with context parallelism between data and Z: X varies fastest,
so an X group is a run of consecutive ranks inside one node,
``rank = (((data * G_context + context) * G_z + z) * G_y + y) * G_x + x``. The data-parallel
gradient group (data x context) is then ``G_data G_context`` ranks at stride ``G_z G_y G_x``."""

EXPERT_GRID_AXES = (Axis.EXPERT_DATA, Axis.EXPERT)
"""The ranks of a pipeline stage as the routed experts see them under expert parallelism
(Megatron-Core's MoE Parallel Folding with expert tensor parallelism 1, Liu et al., arXiv
2504.14960): the stage rank ``r`` (the --grid's rank order, :data:`GRID_AXES`, X fastest) split
as ``r = expert_data G_expert + expert``. The expert axis is innermost, so an expert-parallel
group is ``G_expert`` consecutive ranks: the X ranks first, then Y, Z, context and data, and
inside one node whenever ``G_expert`` is at most its GPUs. No two ranks of an expert group hold
the same expert, whichever axes it spans; an expert-data group is the ``G_stage / G_expert``
ranks at stride ``G_expert`` that hold the same experts."""

ORIENTATIONS = ("xy", "yx")
"""Which mesh dimension plays which role of AxoNN's layer pair. ``xy``: the ``--grid``'s X
dimension (the innermost, ranks ``x`` apart by 1) is the X role (a pair's first layer, QKV or
gate/up, splits its input over X and its output over Y), its Y dimension the Y role. ``yx``: the
roles swap, so the first layer splits its output (its wide side) over the grid's X dimension:
with one tensor axis that is Megatron's column-then-row layout, whatever the axis is called.
The runtime, the planner and the checkpoints work in roles; reports and ``--grid`` name the
mesh dimensions (:func:`physical_axis`)."""

COMM_AXES = (Axis.X, Axis.Y, Axis.Z, Axis.CONTEXT, Axis.DATA, Axis.WORLD)
"""Every group a collective runs over, inner to outer: the order of per-axis reports."""

GridShape = tuple[int, int, int, int, int]
"""``(G_data, G_context, G_z, G_y, G_x)``, in :data:`GRID_AXES` order."""


class GridError(TetradError):
    """A grid that is not four, five or six positive integers (or named sizes), or does not
    match the world size."""


GRID_NAMES = ("pipe", "data", "context", "z", "y", "x")
"""The axes' names in ``--grid``'s named form (``pipe=4,data=2,z=8,y=2,x=2``), outer to inner."""


def parse_pipeline_grid(text: str | Iterable[int]) -> tuple[int, GridShape]:
    """Parse a ``--grid`` with a pipeline axis into ``(G_pipe, (G_data, G_context, G_z, G_y,
    G_x))``: ``"PIPE,DATA,CONTEXT,Z,Y,X"`` (six entries), the four or five entries of
    :func:`parse_grid` (``G_pipe = 1``), or the named form ``"pipe=4,data=2,z=8,y=2,x=2"``
    (names of :data:`GRID_NAMES` in any order, unnamed axes 1).

    Raises:
        GridError: not one of these forms with positive integers.
    """
    if isinstance(text, str) and "=" in text:
        return _parse_named_grid(text)
    parts = _parts(text)
    if len(parts) == 6:
        sizes = _positive_ints(parts)
        if sizes:
            return sizes[0], sizes[1:]  # type: ignore[return-value]
        _bad_grid(text)
    return 1, parse_grid(parts if not isinstance(text, str) else text)


def parse_grid(text: str | Iterable[int]) -> GridShape:
    """Parse ``"DATA,CONTEXT,Z,Y,X"`` or ``"DATA,Z,Y,X"`` (``G_context = 1``), or a sequence
    of five or four, or the named form without ``pipe`` (``"data=2,z=2"``), into
    ``(G_data, G_context, G_z, G_y, G_x)``.

    Raises:
        GridError: not four or five positive integers, or a pipeline axis above 1 (where the
            caller takes none: use :func:`parse_pipeline_grid`).
    """
    if isinstance(text, str) and ("=" in text or len(text.split(",")) == 6):
        pipe, sizes = parse_pipeline_grid(text)
        if pipe > 1:
            raise GridError(f"grid {text!r}: a pipeline axis (pipe={pipe}) is not accepted here")
        return sizes
    parts = _parts(text)
    sizes = _positive_ints(parts)
    if len(sizes) not in (4, 5):
        _bad_grid(text)
    return sizes if len(sizes) == 5 else (sizes[0], 1, *sizes[1:])  # type: ignore[return-value]


def format_grid(pipe: int, sizes: GridShape) -> str:
    """The ``--grid`` text of ``(G_pipe, sizes)``: ``DATA,Z,Y,X`` or ``DATA,CONTEXT,Z,Y,X``
    without a pipeline axis, ``PIPE,DATA,CONTEXT,Z,Y,X`` with one."""
    if pipe > 1:
        return ",".join(map(str, (pipe, *sizes)))
    d, c, z, y, x = sizes
    return ",".join(map(str, (d, z, y, x) if c == 1 else sizes))


def _parts(text: object) -> list:
    """The entries of a grid given as text (comma-separated) or as a list or tuple.

    Raises:
        GridError: anything else (a TOML ``grid = 4``, say).
    """
    if isinstance(text, str):
        return [p.strip() for p in text.split(",")]
    if isinstance(text, list | tuple):
        return list(text)
    _bad_grid(text)


def _positive_ints(parts: list) -> tuple[int, ...]:
    if any(isinstance(p, bool | float) for p in parts):
        return ()  # a TOML true or 2.5 is not a size
    try:
        sizes = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        return ()
    return sizes if sizes and min(sizes) >= 1 else ()


def _parse_named_grid(text: str) -> tuple[int, GridShape]:
    sizes = dict.fromkeys(GRID_NAMES, 1)
    seen = set()
    for item in text.split(","):
        name, _, value = (p.strip() for p in item.partition("="))
        ints = _positive_ints([value])
        if name == "expert":
            raise GridError(
                f"grid {text!r}: expert=N is read by tetrad train and tetrad memory --grid (it "
                "folds over the stage's ranks); elsewhere pass the grid without it"
            )
        if name not in sizes and "=" in item:
            near = difflib.get_close_matches(name, [*GRID_NAMES, "expert"], n=1)
            raise GridError(
                f"grid {text!r}: unknown axis {name!r}"
                + (f" (did you mean {near[0]!r}?)" if near else "")
                + f": name sizes of {', '.join(GRID_NAMES)} or expert, such as data=2,z=2"
            )
        if name not in sizes or name in seen or not ints:
            _bad_grid(text)
        sizes[name] = ints[0]
        seen.add(name)
    pipe, *rest = (sizes[n] for n in GRID_NAMES)
    return pipe, tuple(rest)  # type: ignore[return-value]


def _bad_grid(text: object) -> NoReturn:
    raise GridError(
        f"grid {text!r} is not DATA,Z,Y,X, DATA,CONTEXT,Z,Y,X or PIPE,DATA,CONTEXT,Z,Y,X with "
        "positive integers, nor named sizes such as pipe=2,data=2,y=2 (for example 1,2,1,2)"
    )


def check_orientation(orientation: str) -> str:
    """``orientation`` if it is one of :data:`ORIENTATIONS`.

    Raises:
        GridError: any other value.
    """
    if orientation not in ORIENTATIONS:
        raise GridError(f"orientation {orientation!r} is not one of {', '.join(ORIENTATIONS)}")
    return orientation


def role_sizes(sizes: GridShape, orientation: str) -> GridShape:
    """The sizes of the roles ``(G_data, G_context, G_z, G_y, G_x)`` of the mesh sizes ``sizes``
    (the ``--grid``) under ``orientation``: the last two swap for ``yx``. Its own inverse."""
    d, c, z, y, x = sizes
    return (d, c, z, x, y) if check_orientation(orientation) == "yx" else (d, c, z, y, x)


def physical_axis(axis: str, orientation: str) -> str:
    """The mesh dimension (``--grid`` axis) that plays role ``axis`` under ``orientation``:
    ``x`` and ``y`` swap for ``yx``, every other axis is itself. Its own inverse."""
    if orientation == "yx" and axis in ("x", "y"):
        return "y" if axis == "x" else "x"
    return str(axis)


def check_world_size(sizes: GridShape, world_size: int, pipe: int = 1) -> None:
    """Check ``G_pipe * G_data * G_context * G_z * G_y * G_x == world_size``.

    Raises:
        GridError: the product differs; the message prints the product equation.
    """
    sizes = parse_grid(sizes)
    names = [a.value for a in GRID_AXES]
    if sizes[1] == 1:  # the 4D grid: no context term in the message
        names, sizes = names[:1] + names[2:], sizes[:1] + sizes[2:]
    if pipe > 1:
        names, sizes = ["pipe", *names], (pipe, *sizes)
    product = math.prod(sizes)
    if product != world_size:
        raise GridError(
            f"grid {'*'.join(names)} = {'*'.join(map(str, sizes))} = {product}, but world "
            f"size is {world_size}: choose a --grid whose product is {world_size}"
        )


def pop_expert(text: str) -> tuple[str, str]:
    """A named ``--grid`` such as ``"data=4,expert=2"`` without its ``expert=N`` item, and
    ``N`` (as text): the expert axis folds over the stage's ranks and adds no ranks."""
    items = [i for i in text.split(",") if i.partition("=")[0].strip() != "expert"]
    expert = [i.partition("=")[2].strip() for i in text.split(",") if i not in items]
    return ",".join(items) or "data=1", expert[-1]


def check_expert_parallel(expert: int, sizes: GridShape) -> None:
    """Check that ``G_expert`` divides the ranks of a pipeline stage, ``G_data G_context G_z
    G_y G_x`` (expert parallelism folds over them and adds none: :data:`EXPERT_GRID_AXES`).

    Raises:
        GridError: one line naming the sizes that would do.
    """
    stage = math.prod(with_context(sizes))
    if expert < 1 or stage % expert:
        fits = [n for n in range(1, stage + 1) if stage % n == 0]
        raise GridError(
            f"expert parallelism {expert} must divide the {stage} ranks of a pipeline stage "
            f"(G_data*G_context*G_z*G_y*G_x; it folds over them): use --expert-parallel "
            f"{' or '.join(map(str, fits))}"
        )


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
        GridError: not four positive integers.
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
        raise GridError(f"grid {grid!r} is not (G_data, G_z, G_y, G_x)") from None
    if min(gd, gz, gy, gx) < 1:
        raise GridError(f"grid {grid!r} needs positive sizes G_data, G_z, G_y, G_x")
    return gd, gz, gy, gx
