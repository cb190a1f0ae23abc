"""tetrad's shared vocabulary, defined once for the runtime and the planner (plain Python).

- the axes of the grid and the groups collectives run over (:class:`Axis`);
- grid shapes ``(G_data, G_context, G_z, G_y, G_x)``: parsing and the world-size check;
- the overlap names and their defaults;
- devices, byte units, the TOML reader;
- :class:`TetradError`, the base of every "change your input" error, and the one line the
  ``tetrad`` command prints for it.

Nothing here imports torch, so ``tetrad plan`` and configuration parsing run anywhere.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Iterable
from typing import Literal, NoReturn

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib  # noqa: F401 (re-exported: the one TOML reader)

# ---- byte units ------------------------------------------------------------------------------

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
"""Binary units for memory and buffer sizes. Bandwidths are decimal: GB/s = 1e9 bytes/s."""


# ---- errors ----------------------------------------------------------------------------------


class TetradError(ValueError):
    """A mistake in the user's input; the message is one line saying what to change.

    The ``tetrad`` command prints it as :func:`error_line` and exits with status 2.
    """


def error_line(message: object) -> str:
    """``tetrad: error: <first line of message>``: what the command prints for a mistake."""
    lines = str(message).strip().splitlines()
    return f"tetrad: error: {lines[0] if lines else type(message).__name__}"


# ---- axes and grid shapes --------------------------------------------------------------------


class Axis(str, enum.Enum):
    """A group of ranks a collective runs over: one axis of the grid, or the whole world.

    A ``str`` (``Axis.X == "x"``), so it names DeviceMesh dimensions and JSON keys as is.
    As a group of collectives, ``DATA`` is every rank that holds the same parameter shards and
    sees other tokens outside Z: ``G_data G_context`` ranks (Megatron-LM's data-parallel group
    with context parallelism), over which gradients and losses are summed; ``CONTEXT`` is the
    ``G_context`` ranks holding the chunks of the same sequences (the K/V all-gather).
    ``EXPERT`` (expert parallelism, folded over data x context: no ranks of its own) is the
    ``G_expert`` ranks that split the routed experts and exchange tokens (all-to-all);
    ``EXPERT_DATA`` the ``G_data G_context / G_expert`` ranks holding the same experts, over
    which expert gradients are summed (Megatron-Core's expert-data-parallel group).
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

EXPERT_GRID_AXES = (Axis.EXPERT_DATA, Axis.EXPERT, Axis.Z, Axis.Y, Axis.X)
"""The same ranks seen by the routed experts under expert parallelism (Megatron-Core's
"parallel folding", arXiv 2504.14960): the data x context index ``dc = data G_context +
context`` split as ``dc = expert_data G_expert + expert`` (the expert axis innermost, so an
expert-parallel group is ``G_expert`` consecutive data x context ranks)."""

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
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
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
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
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


def _positive_ints(parts: list) -> tuple[int, ...]:
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
    ``N`` (as text): the expert axis folds over data x context and adds no ranks."""
    items = [i for i in text.split(",") if i.partition("=")[0].strip() != "expert"]
    expert = [i.partition("=")[2].strip() for i in text.split(",") if i not in items]
    return ",".join(items) or "data=1", expert[-1]


def check_expert_parallel(expert: int, sizes: GridShape) -> None:
    """Check that ``G_expert`` divides ``G_data G_context`` (expert parallelism folds over
    those ranks and adds none).

    Raises:
        GridError: one line naming the sizes that would do.
    """
    dc = sizes[0] * sizes[1]
    if expert < 1 or dc % expert:
        fits = [n for n in range(1, dc + 1) if dc % n == 0]
        raise GridError(
            f"expert parallelism {expert} must divide G_data*G_context = {dc} (it folds over "
            f"the data and context ranks): use --expert-parallel {' or '.join(map(str, fits))}"
        )


# ---- overlaps --------------------------------------------------------------------------------

OVERLAPS = (
    "prefetch",
    "reduce_scatter",
    "dx_all_reduce",
    "dp_all_reduce",
    "domino",
    "fine",
    "context",
)
"""What the runtime overlaps with computation (:mod:`tetrad.parallel.overlap`, where each is
described) and the planner models (:mod:`tetrad.plan.comm.estimate`)."""

DEFAULT_OVERLAPS = tuple(o for o in OVERLAPS if o != "fine")
"""The overlaps of a model built without naming any (``ParallelLlama``, ``Overlap``): all but
``fine``, which is on only where named or where the planner predicts a gain
(:func:`tetrad.train.auto.fine_chunks`), as ``tetrad train --overlap all`` without a machine."""

DP_BUCKET_BYTES = 25 * MiB
"""Data-parallel all-reduce bucket size of the ``dp_all_reduce`` overlap, bytes: DDP's default
(``bucket_cap_mb=25``). On the 2-core CPU machine, separate spawns in ABBA order, 6 repeats each,
the ``small`` model's data-parallel step took 0.99x (4 ranks) and 0.99x (2 ranks) of its time
with 4 MiB buckets: fewer gloo calls (each costs about 1 ms of CPU at 4 ranks)."""

DOMINO_MIN_ROWS = 256
"""The ``domino`` overlap splits a forward GEMM only when the micro-batch has at least twice
this many token rows (below it the extra launch costs more than the split hides)."""

LOSS_CHUNK_BYTES = {"cpu": 8 * MiB, "cuda": 1 * GiB}
"""Per device type, the largest fp32 block of logits ``[rows, V/(G_y G_x)]`` that the fused LM
head and cross-entropy (:func:`tetrad.parallel.loss.lm_head_loss`) forms at once, bytes: small
on the CPU (the block stays in cache from its GEMM through the softmax and the gradient's two
GEMMs), large on GPUs (few, large GEMMs and few partial weight-gradient sums)."""


def loss_chunk_rows(vocab_local: int, rows: int, device: str = "cuda") -> int:
    """Token rows per block of the fused LM head and cross-entropy: as many as fit
    :data:`LOSS_CHUNK_BYTES` of the device type (``cuda`` for any accelerator) at
    ``vocab_local`` fp32 logits each, at least 1 and at most ``rows``."""
    budget = LOSS_CHUNK_BYTES.get(device, LOSS_CHUNK_BYTES["cuda"])
    return max(1, min(rows, budget // (4 * vocab_local)))


CONTEXT_PIECES = 8
"""Most pieces of the ``context`` overlap (:mod:`tetrad.parallel.context`): the K/V all-gather
of context-parallel attention is split over (micro-batch, KV head) into at most this many, each
piece's attention running while the next piece travels (the planner models the same rule,
:func:`context_pieces`)."""


def context_pieces(micro_batch: int, kv_heads_local: int, most: int = CONTEXT_PIECES) -> tuple:
    """``(n_b, n_h)``: the ``context`` overlap's pieces over the micro-batch's ``b`` samples and
    this rank's ``kv_heads / G_y`` KV heads: ``n_h`` the largest divisor of ``kv_heads_local``
    not above ``most``, then ``n_b`` the largest divisor of ``micro_batch`` not above
    ``most // n_h``; ``n_b n_h`` pieces in all (``(1, 1)``: one blocking all-gather)."""
    n_h = max(d for d in range(1, min(most, kv_heads_local) + 1) if kv_heads_local % d == 0)
    left = most // n_h
    n_b = max(d for d in range(1, min(left, micro_batch) + 1) if micro_batch % d == 0)
    return n_b, n_h


FINE_CHUNKS = 2
"""Pieces per ring step of the ``fine`` overlap when no ``--machine`` chooses: the fewest that
overlap anything (with one piece per step each fused ``addmm`` waits for the running sum it
folds in, so the ring is serial)."""


class OverlapError(TetradError):
    """An overlap name that is not one of :data:`OVERLAPS`."""


def parse_overlaps(text: str | Iterable[str]) -> frozenset[str]:
    """``"all"``, ``"none"`` or a comma-separated subset of :data:`OVERLAPS` (or the names).

    Raises:
        OverlapError: an unknown name (the message lists the known ones).
    """
    names = [t.strip() for t in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if names == ["all"]:
        return frozenset(OVERLAPS)
    if names in (["none"], []):
        return frozenset()
    bad = [n for n in names if n not in OVERLAPS]
    if bad:
        raise OverlapError(
            f"unknown overlap {bad[0]!r}: use all, none or a comma-separated list "
            f"of {', '.join(OVERLAPS)}"
        )
    return frozenset(names)


# ---- devices and dtypes ----------------------------------------------------------------------

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
"""``cpu`` runs on gloo in fp32; ``cuda`` on NCCL with bf16 autocast."""

FP32 = 4
"""Bytes of an fp32 element: master weights, gradients, optimizer states, norm and loss
statistics."""

DTYPE_BYTES = {"bf16": 2, "fp32": FP32}
"""Compute-dtype bytes. ``"bf16"`` is the runtime on CUDA (bf16 autocast, fp32 master weights,
FlashAttention-style SDPA, foreach AdamW); ``"fp32"`` the runtime on CPU (no autocast, the CPU
flash SDPA kernel, single-tensor AdamW)."""


def compute_dtype(device: str) -> str:
    """The compute dtype of the runtime on ``device``: ``bf16`` on CUDA, ``fp32`` on CPU."""
    return "bf16" if device == "cuda" else "fp32"


PREFETCH_DEPTH = 2
"""Z all-gathers the ``prefetch`` overlap keeps in flight ahead of the weight in use, in
execution order (tetrad/parallel/overlap.py; the planner's replay,
tetrad/plan/comm/zqueue.py): with two, a weight whose all-gather is longer than the layer
before it (Llama's ``w13`` after the short ``wo``) has two layers' compute to hide behind, for
one more gathered weight in memory."""
