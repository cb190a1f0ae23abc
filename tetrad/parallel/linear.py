"""3D tensor-parallel Linear after AxoNN (Singh et al., arXiv 2305.13525, the 4D algorithm).

A weight ``W [n, k]`` (out x in) is split into ``G_out x G_in`` blocks and each block's rows again
over Z. For the non-transposed layer ``in = X, out = Y``:

    x [m/G_z, k/G_x]  x  W block [n/G_y, k/G_x]^T  ->  y [m/G_z, n/G_y]
    (each rank stores W_shard [n/(G_y G_z), k/G_x] of its block)

    forward:   W = all-gather_Z(W_shard);  y = all-reduce_X(x W^T) + b
    backward:  W = all-gather_Z(W_shard);  dx = all-reduce_Y(dy W);   (with the ``fine`` overlap
               each all-reduce is a reduce-scatter fused with its GEMM, then an all-gather)
               dW_shard = reduce-scatter_Z(dy^T x)

``transpose=True`` swaps X and Y, so a non-transposed layer followed by a transposed one (QKV ->
out-proj, gate/up -> down) needs no redistribution of activations.

``sequence_parallel=True``: the input of a non-transposed layer and the output of a transposed
one are split along the sequence over Y (``[b, s/G_y, k/G_x]``, ``[b, s/G_y, n/G_x]``); the
first all-gathers its input and reduce-scatters its input gradient, the second reduce-scatters
its output and all-gathers its output gradient (:mod:`tetrad.parallel.sequence`), in place of
the all-reduces over Y. The first keeps its gathered input ``[b, s, k/G_x]`` for the weight
gradient; with ``regather`` its shard ``[b, s/G_y, k/G_x]``, all-gathered again in backward
(issued before the ``dx`` GEMM, waited before the ``dW`` GEMM).

The weight gradient leaves backward through :meth:`Overlap.reduce_weight_grad` (which fills
``weight.grad``), not through autograd, so its reduce-scatter can run asynchronously; see
:mod:`tetrad.parallel.overlap` for the other overlaps.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from tetrad.comm import all_reduce
from tetrad.dtypes import compute_dtype, fp8_recipe
from tetrad.grid import Grid
from tetrad.parallel.fp8 import Fp8Gemms
from tetrad.parallel.masters import grad_dtype
from tetrad.parallel.overlap import Overlap
from tetrad.parallel.placement import sharded_parameter
from tetrad.parallel.sequence import gather_sequence, scatter_sequence
from tetrad.spec.grid import Axis
from tetrad.spec.precision import fp8_converts


def reduce_weight_gradient(
    ov: Overlap,
    w_shard: nn.Parameter,
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor | None = None,
) -> None:
    """The block gradient ``dy^T x`` (``dy [..., n]``, ``x [..., k]`` -> ``[n, k]``; or ``dw``,
    computed already, as FP8 GEMMs give it), handed to the overlap as ``w_shard``'s (its Z
    reduce-scatter fills ``w_shard.grad``); written straight into its data-parallel bucket
    where the overlap offers a place (:meth:`Overlap.grad_slot`). Cast to the gradients' dtype
    only where a Z reduce-scatter sums it (``G_z > 1``): with ``G_z = 1`` it is added to the
    gradient as it is (:func:`tetrad.parallel.masters.add_grad`: an in-place add across
    dtypes, no fp32 copy of the block). Where the gradient exists already (a later
    micro-batch, ``G_z = 1``, :meth:`Overlap.grad_to_add_into`), the GEMM adds into it, as
    Megatron-LM's gradient-accumulation fusion does: ``addmm_`` where the gradient has the
    operands' dtype, ``torch.addmm(..., out_dtype=fp32, out=grad)`` for bf16 operands and an
    fp32 gradient where torch runs it (:func:`adds_into_fp32`). No block tensor and no separate
    add, which moves 10-12 bytes per element (read both, write the sum) per micro-batch: on a
    GPU 24 ms per micro-batch for 8B local parameters at 3.35 TB/s."""
    have = ov.grad_to_add_into(w_shard) if dw is None else None
    a, b = dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])
    if have is not None and gemm_adds_into(have, a, b):
        ov.weight_grad_added(w_shard)
        return
    slot = ov.grad_slot(w_shard)
    if dw is None:
        if slot is not None and a.dtype == slot.dtype:
            dw = torch.mm(a, b, out=slot)
        else:
            dw = a @ b
    if slot is None:
        dw = dw.to(grad_dtype(w_shard)) if ov.grid.z > 1 else dw
    elif dw is not slot:  # the cast to the parameter dtype lands in the slot
        dw = slot.copy_(dw)
    ov.reduce_weight_grad(w_shard, dw)


def gemm_adds_into(
    have: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 1.0
) -> bool:
    """``have = beta have + alpha a b`` by the GEMM itself (``have [n, k]``, ``a [n, m]``,
    ``b [m, k]``; ``beta = 0``: ``have``'s contents are not read) where the dtypes allow
    (:func:`reduce_weight_gradient`); False, with ``have`` untouched, where they do not."""
    if a.dtype != b.dtype:
        return False
    if have.dtype == a.dtype:
        have.addmm_(a, b, beta=beta, alpha=alpha)
    elif have.dtype == torch.float32 and adds_into_fp32(have.device, a.dtype):
        torch.addmm(have, a, b, out_dtype=torch.float32, beta=beta, alpha=alpha, out=have)
    else:
        return False
    return True


@functools.cache
def adds_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` adds the product of
    ``dtype`` (bf16/fp16) matrices into an fp32 ``c`` in place on ``device``: cuBLAS accumulates
    in fp32 and writes fp32 (PyTorch pull request 150812); versions differ in whether ``c`` may
    be fp32, and the CPU has no such kernel. Tried once per device and dtype on a 2 x 2 case
    against the fp32 product; False on any error."""
    if device.type != "cuda":
        return False
    try:
        with torch.no_grad():
            a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
            c = torch.full((2, 2), 0.5, device=device)
            want = c + a @ a
            torch.addmm(c, a.to(dtype), a.to(dtype), out_dtype=torch.float32, out=c)
            return bool(torch.equal(c, want))
    except (RuntimeError, TypeError):
        return False


class _Linear3D(torch.autograd.Function):
    """``y = all-reduce_in(x @ all-gather_Z(W_shard)^T)``; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        x,
        w_shard,
        ov: Overlap,
        in_axis: Axis,
        out_axis: Axis,
        sequence: bool,
        regather: bool = False,
        fp8: Fp8Gemms | None = None,
    ):
        # sequence parallelism: the first layer of a pair (out over Y) gathers its
        # input along the sequence, the second (in over Y) reduce-scatters its output
        gathers, scatters = sequence and out_axis == Axis.Y, sequence and in_axis == Axis.Y
        dtype = compute_dtype(x)
        x_shape = x.shape
        x = shard = x.to(dtype)
        w = ov.gather_weight(w_shard, fp8.weight_format(dtype) if fp8 else dtype)
        if gathers:
            x = gather_sequence(x, ov.grid)
        rows = x.reshape(-1, x.shape[-1])
        out_shape = (*x.shape[:-1], w.shape[0])
        ctx.fp8, ctx.x_scale = fp8, None
        if fp8 is not None:  # the GEMM whole, then its collective (tetrad/parallel/fp8.py)
            y, ctx.x_scale = fp8.forward(rows, w)
            if scatters:
                y = scatter_sequence(y.view(out_shape), ov.grid)
            else:
                y = all_reduce(y, ov.grid, in_axis).view(out_shape)
        elif scatters:
            y = scatter_sequence((rows @ w.t()).view(out_shape), ov.grid)
        else:
            y = ov.forward_gemm_all_reduce(rows, w, in_axis).view(out_shape)
        ctx.regather = gathers and regather  # keep the shard, gather it again in backward
        ctx.save_for_backward(shard if ctx.regather else x)
        # The Parameter object itself (a saved tensor comes back as an alias under activation
        # checkpointing): its .grad is filled by the overlap and its identity drives prefetch.
        ctx.weight, ctx.ov, ctx.out_axis, ctx.dtype = w_shard, ov, out_axis, dtype
        ctx.gathers, ctx.scatters, ctx.x_shape = gathers, scatters, x_shape
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        w_shard, ov, dtype = ctx.weight, ctx.ov, ctx.dtype
        if ctx.regather:  # [b, s/G_y, k] -> [b, s, k], in flight during the dx GEMM
            x = gather_sequence(x, ov.grid, async_op=True)
        dy = dy.to(dtype)
        if ctx.scatters:  # [b, s/G_y, n] -> [b, s, n]
            dy = gather_sequence(dy, ov.grid)
        fp8 = ctx.fp8
        w = ov.gather_weight(w_shard, fp8.weight_format(dtype) if fp8 else dtype)
        rows = dy.reshape(-1, dy.shape[-1])
        if fp8 is not None:
            dx, dy8 = fp8.grad_input(rows, w)
            if ctx.gathers:
                dx = ov.backward_scatter_sequence(dx.view(*dy.shape[:-1], w.shape[1]))
            else:
                dx = ov.backward_all_reduce(dx, ctx.out_axis)
        elif ctx.gathers:  # dx [b, s, k] -> [b, s/G_y, k], during the dW GEMM
            dx = ov.backward_scatter_sequence((rows @ w).view(*dy.shape[:-1], w.shape[1]))
        else:
            dx = ov.backward_gemm_all_reduce(rows, w, ctx.out_axis)  # runs during the dW GEMM
        if ctx.regather:
            x = x.wait()
        dw = None
        if fp8 is not None:
            dw = fp8.grad_weight(rows, x.reshape(-1, x.shape[-1]), ctx.x_scale, dy8)
        reduce_weight_gradient(ov, w_shard, dy, x, dw)
        return dx.wait().view(ctx.x_shape), None, None, None, None, None, None, None


class Linear(nn.Module):
    """3D tensor-parallel ``y = x W^T + b`` with ``W [out_features, in_features]``.

    Shapes (non-transposed; swap X and Y when ``transpose=True``):
        input ``[..., in_features/G_x]`` (replicated over Y), output ``[..., out_features/G_y]``
        (replicated over X); leading dims are this rank's tokens ``[B/(G_data G_z), S]``.
        ``weight`` is stored as ``[out/(G_y G_z), in/G_x]``; ``bias`` as ``[out/G_y]``,
        replicated over X, Z and data (its gradient is summed over Z and data by
        :func:`tetrad.parallel.grads.sync_gradients`).

    ``stacked=s``: the weight is ``s`` matrices of ``out/s`` rows stacked (SwiGLU's gate and
    up), global ``[s, out/s, in]``, each split over the out axis and Z alike
    (:attr:`tetrad.parallel.placement.Placement.stacked`). The stored ``[out/(G_y G_z),
    in/G_x]`` is then ``s`` row blocks, one per matrix, and the output ``[..., out/G_y]`` is
    ``G_z`` pieces (the Z all-gather's order) of ``s`` contiguous blocks each
    (:func:`tetrad.models.swiglu.swiglu` takes them so).

    With ``sequence_parallel`` the input of a non-transposed layer is
    ``[b, s/G_y, in_features/G_x]`` and the output of a transposed one
    ``[b, s/G_y, out_features/G_x]``, this Y rank's piece of the sequence
    (:mod:`tetrad.parallel.sequence`). ``regather`` (with ``sequence_parallel``): a
    non-transposed layer saves that piece for its weight gradient and all-gathers it again in
    backward, instead of saving the gathered ``[b, s, in_features/G_x]``.

    Raises:
        ValueError: a size not divisible by the grid (check the model with
            :func:`tetrad.spec.sharding.check_grid` first for a friendlier message), or
            ``sequence_parallel`` or ``stacked`` with a bias.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        grid: Grid,
        *,
        transpose: bool = False,
        bias: bool = False,
        init_std: float = 0.02,
        overlap: Overlap | None = None,
        sequence_parallel: bool = False,
        regather: bool = False,
        stacked: int = 1,
    ):
        super().__init__()
        if sequence_parallel and bias:
            raise ValueError("a sequence-parallel Linear takes no bias")
        if stacked > 1 and bias:
            raise ValueError("a stacked Linear takes no bias (its rows are not in global order)")
        if regather and not sequence_parallel:
            raise ValueError("regather needs sequence_parallel (it re-gathers its input)")
        self.sequence_parallel = sequence_parallel and grid.y > 1
        self.regather = regather and self.sequence_parallel
        self.overlap = overlap if overlap is not None else Overlap(grid, enabled=())
        self.in_axis, self.out_axis = (Axis.Y, Axis.X) if transpose else (Axis.X, Axis.Y)
        g_in, g_out = grid.size(self.in_axis), grid.size(self.out_axis)
        if in_features % g_in or out_features % (stacked * g_out * grid.z):
            raise ValueError(
                f"Linear {in_features}->{out_features} needs in % G_{self.in_axis} == 0 and "
                f"out % ({stacked}*G_{self.out_axis}*G_z) == 0 on grid {grid}"
            )
        self.grid, self.in_features, self.out_features = grid, in_features, out_features
        shape, rows = (out_features, in_features), (self.out_axis, Axis.Z)
        self.weight = sharded_parameter(
            shape if stacked == 1 else (stacked, out_features // stacked, in_features),
            (rows, (self.in_axis,)) if stacked == 1 else ((), rows, (self.in_axis,)),
            grid,
            ("normal", init_std),
            stacked=stacked > 1,
        )
        self.bias = (
            sharded_parameter((out_features,), ((self.out_axis,),), grid, ("zeros",))
            if bias
            else None
        )
        self._fp8_gemms: dict[tuple[str, str], Fp8Gemms] = {}  # (recipe, device type) -> GEMMs

    @torch.compiler.disable  # collectives and the overlap state stay outside compiled graphs
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k_local = self.in_features // self.grid.size(self.in_axis)
        assert x.shape[-1] == k_local, f"expected [..., {k_local}], got {tuple(x.shape)}"
        y = _Linear3D.apply(
            x,
            self.weight,
            self.overlap,
            self.in_axis,
            self.out_axis,
            self.sequence_parallel,
            self.regather,
            self._fp8(x.device),
        )
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _fp8(self, device: torch.device) -> Fp8Gemms | None:
        """This Linear's FP8 GEMMs under the active policy's recipe (:func:`fp8_recipe`), or
        None where it runs in the compute dtype (:func:`fp8_converts`)."""
        recipe = fp8_recipe()
        if not fp8_converts(recipe, self.out_features, self.in_features):
            return None
        key = (recipe, device.type)
        if key not in self._fp8_gemms:
            self._fp8_gemms[key] = Fp8Gemms(recipe, self.grid, self.in_axis, self.out_axis, device)
        return self._fp8_gemms[key]

    def extra_repr(self) -> str:
        return (
            f"{self.in_features}->{self.out_features}, in over {self.in_axis.upper()}, "
            f"out over {self.out_axis.upper()}, bias={self.bias is not None}"
            + (", sequence-parallel" if self.sequence_parallel else "")
            + (" (input gathered again in backward)" if self.regather else "")
        )
