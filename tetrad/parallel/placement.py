"""Where each parameter lives on the grid, and grid-independent initialisation.

A :class:`Placement` says, for each tensor dimension, which grid axes split it (outer to inner).
Every shard is then a rectangle of the global tensor at a known offset, and an axis not named is
one over which the parameter is replicated. Gradient synchronisation, global-norm clipping and
checkpoints read only this. A stacked weight (SwiGLU's ``w13``: gate and up, ``[2, f, h]``) is
stored as its rectangle with the two leading dims merged, the 2D weight of one GEMM
(:attr:`Placement.stacked`).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from tetrad.grid import Grid
from tetrad.models.meta import materialize
from tetrad.spec.grid import EXPERT_GRID_AXES, GRID_AXES, Axis

# Replicated axes whose ranks see different tokens: gradients are summed over them.
TOKEN_AXES = (Axis.Z, Axis.DATA)


@dataclass(frozen=True)
class Placement:
    """Layout of one parameter on the grid.

    Attributes:
        shape: the global (unsharded) shape.
        split: per tensor dim, the axes splitting it, outer to inner; e.g. a non-transposed
            Linear weight ``[n, k]`` has ``(("y", "z"), ("x",))``: rows in ``G_y`` blocks, each
            block's rows again in ``G_z`` pieces, columns in ``G_x`` blocks.
        sum_axes: further replicated axes whose ranks see other tokens or heads with this
            parameter, so its gradient is summed over them too: Y and X for the MoE router and
            experts on tensor grids (each tensor rank routes its own slice of the tokens,
            :mod:`tetrad.parallel.moe_tensor`), Y for per-head q/k norm weights (heads split
            over Y).
        stacked: the global tensor ``[s, n/s, k]`` stacks ``s`` matrices split alike (dim 0
            unsplit; SwiGLU's gate and up, ``s = 2``) and the parameter stores its rectangle
            ``[s, n/(s G_out G_z), k/G_in]`` as the 2D ``[n/(G_out G_z), k/G_in]``: every
            stacked matrix's rows of this rank in one GEMM weight (:meth:`param_shape`).
    """

    shape: tuple[int, ...]
    split: tuple[tuple[str, ...], ...]
    sum_axes: tuple[str, ...] = ()
    stacked: bool = False

    @property
    def sharded_axes(self) -> tuple[str, ...]:
        return tuple(a for dim in self.split for a in dim)

    @property
    def expert_sharded(self) -> bool:
        """Whether the tensor is split over the expert axis (a routed expert's weight): its
        grid is then :data:`tetrad.spec.grid.EXPERT_GRID_AXES`, the stage's ranks seen as
        expert-data x expert."""
        return Axis.EXPERT in self.sharded_axes

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        axes = EXPERT_GRID_AXES if self.expert_sharded else GRID_AXES
        return tuple(a for a in axes if a not in self.sharded_axes)

    @property
    def grad_sum_axes(self) -> tuple[str, ...]:
        """Replicated axes over which the gradient must be summed (they see other tokens):
        Z and data, then :attr:`sum_axes`; for an expert-sharded weight expert-data alone,
        every other rank of the stage that holds the same experts (Z, Y and X included; each
        sums the tokens its experts received, so no rescaling: losses are sums divided by the
        global token count)."""
        if self.expert_sharded:
            return (Axis.EXPERT_DATA,)
        return tuple(a for a in TOKEN_AXES + self.sum_axes if a not in self.sharded_axes)

    def local_slices(self, grid: Grid) -> tuple[slice, ...]:
        """This rank's rectangle of the global tensor, one slice per dim."""
        out = []
        for d, axes in enumerate(self.split + ((),) * (len(self.shape) - len(self.split))):
            parts, index = 1, 0
            for a in axes:
                parts, index = parts * grid.size(a), index * grid.size(a) + grid.coord[a]
            size = self.shape[d] // parts
            out.append(slice(index * size, (index + 1) * size))
        return tuple(out)

    def local_shape(self, grid: Grid) -> tuple[int, ...]:
        """The shape of this rank's rectangle (:meth:`local_slices`)."""
        return tuple(s.stop - s.start for s in self.local_slices(grid))

    def param_shape(self, grid: Grid) -> tuple[int, ...]:
        """The shape of the stored parameter: :meth:`local_shape`, with dims 0 and 1 merged
        when :attr:`stacked`."""
        shape = self.local_shape(grid)
        return (shape[0] * shape[1], *shape[2:]) if self.stacked else shape

    def shard_of(self, full: torch.Tensor, grid: Grid) -> torch.Tensor:
        """This rank's parameter cut from ``full``, the global tensor in :attr:`shape` or any
        shape of the same elements in the same order (a stacked weight's plain ``[n, k]``):
        ``[*param_shape(grid)]``, a view where slicing allows."""
        return full.reshape(self.shape)[self.local_slices(grid)].reshape(self.param_shape(grid))


def sharded_parameter(
    shape: tuple[int, ...],
    split: tuple[tuple[str, ...], ...],
    grid: Grid,
    init: tuple,
    sum_axes: tuple[str, ...] = (),
    stacked: bool = False,
) -> nn.Parameter:
    """An uninitialised local shard ``Placement(shape, split, sum_axes, stacked)
    .param_shape(grid)`` tagged with its placement and its init rule (see
    :func:`init_parameters`): on the grid's device, or on the meta device inside ``with
    torch.device("meta")`` (how the models are built: :func:`tetrad.models.meta.materialize`
    then allocates it on the grid's device)."""
    placement = Placement(tuple(shape), split, tuple(sum_axes), stacked)
    device = "meta" if torch.get_default_device().type == "meta" else grid.device
    p = nn.Parameter(torch.empty(placement.param_shape(grid), device=device))
    p.placement = placement
    p.init = init
    return p


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, grid: Grid | None = None) -> None:
    """Fill every parameter from ``(seed, parameter name)`` only, whatever the grid.

    Parameters still on the meta device are first given storage on the grid's device (without
    ``grid``: the device of the model's other parameters, else the CPU;
    :func:`tetrad.models.meta.materialize`). Each parameter carries ``init``:
    ``("normal", std)`` for a weight of 2 or more dims, ``("ones",)`` or ``("zeros",)``. A
    normal weight is this rank's block of one global tensor (:func:`normal_slice`), drawn on
    the parameter's device, so a parameter's full value is the same on every grid and no rank
    ever makes more than its own shards. Parameters without ``placement`` are full tensors.
    """
    real = [p.device for p in model.parameters() if not p.is_meta]
    device = grid.device if grid is not None else (real[0] if real else torch.device("cpu"))
    materialize(model, device)
    for name, p in model.named_parameters():
        kind = getattr(p, "init", ("normal", 0.02) if p.dim() == 2 else ("ones",))
        if kind[0] == "ones":
            p.fill_(1.0)
        elif kind[0] == "zeros":
            p.zero_()
        else:
            placement = getattr(p, "placement", None)
            if placement is None:
                normal_slice(seed, name, tuple(p.shape), (), kind[1], out=p)
            else:
                normal_slice(
                    seed, name, placement.shape, placement.local_slices(grid), kind[1], out=p
                )


# Elements per chunk of :func:`normal_slice` (two int32 buffers of this size live at once): on
# the CPU per torch thread (each thread's part of an operation stays in its core's cache), on
# a GPU few enough kernel launches (16 per chunk).
CHUNK_ELEMENTS = {"cpu": 1 << 16, "cuda": 1 << 24}
_LIMIT = 1 << 31  # row and column indices are int32


@torch.no_grad()
def normal_slice(
    seed: int,
    name: str,
    shape: tuple[int, ...],
    slices: tuple[slice, ...],
    std: float,
    *,
    out: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The block ``slices`` of the ``normal(0, std)`` tensor of global ``shape`` drawn for
    ``(seed, name)``: the same values whatever the block, the chunking and the device.

    The global tensor is viewed ``[R, C]`` (``R = prod(shape[:-1])`` rows, an expert weight
    ``[E, F, h]`` has ``E F``; ``C = shape[-1]``). Element ``(r, c)`` is a function of
    ``(seed, name, r, c)`` alone, a counter-based generator (the idea of Salmon et al., "Parallel
    random numbers: as easy as 1, 2, 3", SC 2011), evaluated elementwise on the device:

    - keys ``k0..k3``: the 16-byte BLAKE2b digest of ``f"{seed}:{name}"``, four 32-bit words;
    - row key ``a[r] = m(m(r ^ k0) ^ k1)``, column key ``b[c] = m(m(c ^ k2) ^ k3)``, and the
      element's 32 random bits ``h = m(a[r] ^ b[c])``, where ``m`` is the 32-bit integer mixer
      ``lowbias32`` (C. Wellons, "Prospecting for hash functions", 2018; a bijection:
      ``x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16``), done on
      int32 tensors: multiplication modulo ``2**32`` in two's complement, logical shifts as
      an arithmetic shift and a mask (exact on CPU and CUDA; ``tests/test_init.py`` checks it
      against Python integers);
    - ``v = float32(h as signed int32) * (1 - 2**-24) / 2**31``, uniform in ``(-1, 1)``
      (``|v| <= 1 - 2**-24``; float32 keeps the top 24 bits of ``h``), and the normal by the
      inverse CDF ``z = sqrt(2) erfinv(v)`` (``|z| <= 5.42``): the value ``std * z`` in
      float32.

    The integer part is bit-exact everywhere and every step is elementwise, so a block is
    the same whatever the grid and the chunking; CPU and CUDA differ only by their float32
    ``erfinv`` (a few units in the last place, ``tests/test_init.py``). Work is done a chunk
    at a time, in two int32 buffers of at most half the block and :data:`CHUNK_ELEMENTS`
    elements (on the CPU, that many per ``torch.get_num_threads()``), so never more than one
    block's bytes of float32. On the CPU each operation is shared by torch's threads, as in
    training: on cores that other processes keep busy, every operation waits for the slowest
    thread (2 shared cores, llama-1b: 24 s with 2 threads where 1 thread takes 5 s; on 16
    idle cores 1.0 to 1.6 s with 16).

    Args:
        shape: the global shape; ``R`` and ``C`` below ``2**31``.
        slices: one ``slice`` (step 1) per leading dim of ``shape``; missing ones are whole.
        out: the block's tensor (``[len(s) for s in slices]``, contiguous) to write, on any
            device and floating dtype; else a new float32 tensor on ``device``.

    Returns:
        ``out``.
    """
    shape = tuple(shape)
    dims = shape if shape else (1,)
    full = tuple(slices) + tuple(slice(0, n) for n in dims[len(slices) :])
    local = tuple(s.stop - s.start for s in full)
    if out is None:
        out = torch.empty(local, device=device)
    rows, cols = math.prod(dims[:-1]), dims[-1]
    if rows >= _LIMIT or cols >= _LIMIT:
        raise ValueError(f"{name}: {shape} has 2**31 rows or columns or more")
    dev = out.device
    k0, k1, k2, k3 = _keys(seed, name)
    row_ids = torch.zeros(1, dtype=torch.int64, device=dev)
    for d, s in enumerate(full[:-1]):
        stride = math.prod(dims[d + 1 : -1])
        step = torch.arange(s.start, s.stop, device=dev) * stride
        row_ids = (row_ids[:, None] + step).flatten()
    a = _mix(_mix(row_ids.to(torch.int32) ^ k0) ^ k1)
    b = _mix(
        _mix(torch.arange(full[-1].start, full[-1].stop, dtype=torch.int32, device=dev) ^ k2) ^ k3
    )
    dst = out.view(-1, local[-1])
    chunk = CHUNK_ELEMENTS.get(dev.type, CHUNK_ELEMENTS["cuda"])
    if dev.type == "cpu":
        chunk *= torch.get_num_threads()
    budget = max(1, min(chunk, out.numel() // 2))
    col_step = min(local[-1], budget)
    row_step = max(1, budget // col_step)
    xbuf = torch.empty(min(budget, out.numel()), dtype=torch.int32, device=dev)
    tbuf = torch.empty_like(xbuf)
    scale = std * math.sqrt(2.0)
    for r0 in range(0, dst.shape[0], row_step):
        r1 = min(r0 + row_step, dst.shape[0])
        for c0 in range(0, local[-1], col_step):
            c1 = min(c0 + col_step, local[-1])
            shape2d = (r1 - r0, c1 - c0)
            x, t = (buf[: shape2d[0] * shape2d[1]].view(shape2d) for buf in (xbuf, tbuf))
            _normal_chunk(a[r0:r1, None], b[None, c0:c1], x, t, dst[r0:r1, c0:c1], scale)
    return out


def _normal_chunk(
    a: torch.Tensor,
    b: torch.Tensor,
    x: torch.Tensor,
    t: torch.Tensor,
    dst: torch.Tensor,
    scale: float,
) -> None:
    """``dst [r, c] = scale * erfinv(v(m(a ^ b)))`` (:func:`normal_slice`): ``a [r, 1]``,
    ``b [1, c]`` int32 keys, ``x`` and ``t`` int32 ``[r, c]`` scratch."""
    torch.bitwise_xor(a, b, out=x)
    _mix(x, t)
    f = t.view(torch.float32)
    f.copy_(x)
    f.mul_(_TO_UNIT).erfinv_()
    torch.mul(f, scale, out=dst)


_TO_UNIT = (1.0 - 2.0**-24) * 2.0**-31  # int32 -> (-1, 1), exact in float32
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)  # lowbias32's multipliers as int32


def _mix(x: torch.Tensor, tmp: torch.Tensor | None = None) -> torch.Tensor:
    """``lowbias32`` (see :func:`normal_slice`) of every int32 element of ``x``, in place
    (``tmp``: a scratch tensor of ``x``'s shape and dtype)."""
    tmp = torch.empty_like(x) if tmp is None else tmp
    for shift, mult in ((16, _M1), (15, _M2), (16, None)):
        torch.bitwise_right_shift(x, shift, out=tmp)
        x.bitwise_xor_(tmp.bitwise_and_((1 << (32 - shift)) - 1))
        if mult is not None:
            x.mul_(mult)
    return x


def _keys(seed: int, name: str) -> tuple[int, int, int, int]:
    """Four 32-bit keys of ``(seed, name)`` (BLAKE2b), as signed int32 values."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=16).digest()
    words = (int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4))
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)
