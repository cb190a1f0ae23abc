"""FP8 GEMMs of the 3D tensor-parallel Linear (``--fp8``), cast as torchao.float8 casts them.

A block Linear's three GEMMs (forward ``y = x W^T``, ``dx = dy W``, ``dW = dy^T x``) run on FP8
operands, each cast with a dynamic scale by torchao's own functions and configuration (the
recipe's ``Float8LinearConfig``, the roles and axes of ``matmul_with_hp_or_float8_args`` in
``torchao/float8/float8_linear.py``); the GEMM is torchao's ``torch.mm`` of two
``Float8TrainingTensor`` (``torch._scaled_mm`` on CUDA, its emulation elsewhere). The
outputs and everything saved for backward stay in the compute dtype. Which Linears:
:func:`tetrad.spec.precision.fp8_converts`.

Scales on the grid (``W [n, k]`` stored as ``[n/(G_out G_z), k/G_in]``; this rank's ``x
[m, k/G_in]`` and ``dy [m, n/G_out]``):

- ``tensorwise`` (one scale per tensor). The weight's is the whole tensor's: the shard's amax is
  all-reduced (max) over Z, then the output and input axes (those above 1), and the shard cast
  before its Z all-gather, which then moves 1 byte per element (:class:`Fp8WeightGather`, the
  format :meth:`tetrad.parallel.overlap.Overlap.gather_weight` gathers in; FSDP2's float8
  all-gather does the same over its shards). Every gather computes it afresh (forward, backward
  and recompute: the weight does not change within a step, so it is the same scale). The
  activations' amax is all-reduced over the tensor axis that splits their features within the
  micro-batch (``x`` over the input axis, ``dy`` over the output axis, as torchao's
  tensor-parallel float8 reduces its inputs' amax over the TP mesh) and over context, whose
  ranks hold the other chunks of the same sequences; the data and Z ranks hold other samples
  and keep their own (as data-parallel float8 does). So a rank casts each operand with the
  scale one process holding the micro-batch of this (data, Z) cell would use: the grids give
  the single-process run's FP8 values. ``x``'s forward scale is reused for the weight
  gradient's cast.
- ``rowwise`` (a scale per row of ``x`` and ``dy`` and per output feature of ``W``; torchao's
  recipe rounds scales to powers of 2). Every scale is this rank's piece's (none is
  all-reduced; each partial product is scaled consistently); the weight is gathered over Z in
  the compute dtype and cast after.

The Domino and ``fine`` overlaps split or fuse a GEMM with its all-reduce; an FP8 Linear runs
its GEMM whole, then the collective (the planner models it so).

torchao is imported only when a recipe is used: ``pip install 'tetrad[fp8]'`` (torchao 0.18.0).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tetrad.comm import all_reduce
from tetrad.grid import Grid
from tetrad.spec.grid import Axis
from tetrad.spec.precision import FP8_RECIPES


def torchao_float8():
    """The ``torchao.float8`` modules this file uses, as a namespace.

    Raises:
        RuntimeError: torchao is not installed (one line that says how to install it).
    """
    # torchao's import warns once per process that it cannot load its CUDA extensions (on a
    # CPU), and torch's pytree about one of its enums: neither concerns the float8 casts
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import (
            config,
            float8_scaling_utils,
            float8_training_tensor,
            float8_utils,
        )
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "--fp8 needs torchao: pip install 'tetrad[fp8]' (torchao==0.18.0), or --fp8 off"
        ) from e
    finally:
        for log, level in zip(quiet, levels, strict=True):
            log.setLevel(level)
    return _Namespace(config, float8_scaling_utils, float8_training_tensor, float8_utils)


@dataclasses.dataclass(frozen=True)
class _Namespace:
    config: object
    scaling: object
    tensor: object
    utils: object


class Fp8Gemms:
    """The FP8 GEMMs of one Linear under ``recipe`` (module doc).

    Args:
        recipe: ``tensorwise`` or ``rowwise`` (:data:`tetrad.spec.precision.FP8_RECIPES`).
        grid: the Linear's grid; ``in_axis``, ``out_axis``: the axes splitting ``W``'s input
            and output features.
        device: where the GEMMs run: CUDA uses ``torch._scaled_mm``, elsewhere torchao's
            emulation (the same casts and scales, the product in the compute dtype).

    Raises:
        ValueError: an unknown recipe.
        RuntimeError: torchao is not installed.
    """

    def __init__(
        self, recipe: str, grid: Grid, in_axis: Axis, out_axis: Axis, device: torch.device
    ):
        if recipe not in FP8_RECIPES or recipe == "off":
            raise ValueError(f"FP8 recipe {recipe!r}: use one of {', '.join(FP8_RECIPES[1:])}")
        ao = self.ao = torchao_float8()
        cfg = ao.config.Float8LinearConfig.from_recipe_name(recipe)
        if torch.device(device).type != "cuda":
            cfg = dataclasses.replace(cfg, emulate=True)
        self.recipe, self.config = recipe, cfg
        self.grid, self.in_axis, self.out_axis = grid, in_axis, out_axis

        def mm(gemm):
            return ao.tensor.ScaledMMConfig(
                cfg.emulate, gemm.use_fast_accum, False, cfg.pad_inner_dim
            )

        self.mm_config = ao.tensor.LinearMMConfig(
            mm(cfg.gemm_config_output),
            mm(cfg.gemm_config_grad_input),
            mm(cfg.gemm_config_grad_weight),
        )
        roles = ao.tensor.GemmInputRole
        self.INPUT, self.WEIGHT, self.GRAD_OUTPUT = roles.INPUT, roles.WEIGHT, roles.GRAD_OUTPUT

    @property
    def tensorwise(self) -> bool:
        """One scale per tensor: the weight is gathered over Z in FP8."""
        return self.recipe == "tensorwise"

    def weight_format(self, dtype: torch.dtype) -> torch.dtype | Fp8WeightGather:
        """What the weight's Z all-gather moves: :class:`Fp8WeightGather` under ``tensorwise``,
        else the compute dtype ``dtype`` (cast after the gather)."""
        return Fp8WeightGather(self, dtype) if self.tensorwise else dtype

    def scale(self, t: torch.Tensor, cast, axiswise_dim: int, axes: tuple[Axis, ...]):
        """torchao's dynamic scale of ``t`` for the cast config ``cast`` (the amax whole, or
        along ``axiswise_dim`` for rowwise), its tensorwise amax first all-reduced (max) over
        ``axes`` (those above 1)."""
        ao, granularity = self.ao, cast.scaling_granularity
        dim = ao.scaling.get_maybe_axiswise_dim(axiswise_dim, granularity)
        amax = ao.utils.tensor_to_amax(t, scaling_granularity=granularity, axiswise_dim=dim)
        if granularity is ao.config.ScalingGranularity.TENSORWISE:
            amax = amax.float()
            for axis in axes:
                if self.grid.size(axis) > 1:
                    all_reduce(amax, self.grid, axis, op="max")
        return ao.utils.amax_to_scale(
            amax,
            cast.target_dtype,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def cast(self, t: torch.Tensor, cast, role, axiswise_dim: int, axes=(), scale=None):
        """``t`` as a ``Float8TrainingTensor`` under ``cast`` (its scale given, or
        :meth:`scale`)."""
        ao, granularity = self.ao, cast.scaling_granularity
        dim = ao.scaling.get_maybe_axiswise_dim(axiswise_dim, granularity)
        if scale is None:
            scale = self.scale(t, cast, axiswise_dim, axes)
        return ao.tensor.hp_tensor_and_scale_to_float8(
            t, scale, cast.target_dtype, self.mm_config, role, dim
        )

    def forward(self, x: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(x W^T [m, n], x's scale)`` for ``x [m, k]`` and ``w [n, k]`` (FP8 when gathered
        so, else in the compute dtype); the scale (a scalar, for :meth:`grad_weight`) under
        tensorwise only: rowwise casts ``x`` for the weight gradient along the other axis."""
        cfg = self.config
        x8 = self.cast(x, cfg.cast_config_input, self.INPUT, -1, (self.in_axis, Axis.CONTEXT))
        if isinstance(w, self.ao.tensor.Float8TrainingTensor):
            w_t = w.t()
        else:
            w_t = self.cast(w.t(), cfg.cast_config_weight, self.WEIGHT, 0)
        return torch.mm(x8, w_t), (x8._scale if self.tensorwise else None)

    def grad_input(self, dy: torch.Tensor, w):
        """``(dy W [m, k], dy cast for the weight gradient or None)`` for ``dy [m, n]``."""
        cfg = self.config
        axes = (self.out_axis, Axis.CONTEXT)
        dy8 = self.cast(dy, cfg.cast_config_grad_output, self.GRAD_OUTPUT, -1, axes)
        if isinstance(w, self.ao.tensor.Float8TrainingTensor):
            w_t = w.t()
        else:
            w_t = self.cast(w.t(), cfg.cast_config_weight_for_grad_input, self.WEIGHT, -1)
        reuse = self.tensorwise  # the same cast config: torchao's second cast gives the same
        return torch.mm(dy8, w_t.t()), (dy8 if reuse else None)

    def grad_weight(self, dy: torch.Tensor, x: torch.Tensor, x_scale, dy8=None) -> torch.Tensor:
        """``dy^T x [n, k]`` for ``dy [m, n]``, ``x [m, k]`` (``x_scale``: its forward scale,
        reused under tensorwise; ``dy8``: :meth:`grad_input`'s cast, where it serves)."""
        cfg = self.config
        if dy8 is None:
            cast = cfg.cast_config_grad_output_for_grad_weight
            dy8 = self.cast(dy, cast, self.GRAD_OUTPUT, 0, (self.out_axis, Axis.CONTEXT))
        scale = x_scale if self.tensorwise else None
        x8 = self.cast(x, cfg.cast_config_input_for_grad_weight, self.INPUT, 0, (), scale)
        return torch.mm(dy8.t(), x8)


class Fp8WeightGather:
    """The ``tensorwise`` weight format of the Z all-gather: the shard cast with the whole
    tensor's scale, its FP8 bytes gathered, the gathered block wrapped with that scale
    (``Float8TrainingTensor [n/G_out, k/G_in]``)."""

    def __init__(self, gemms: Fp8Gemms, dtype: torch.dtype):
        self.gemms, self.dtype = gemms, dtype

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Fp8WeightGather)
            and other.gemms is self.gemms
            and other.dtype == self.dtype
        )

    def __hash__(self) -> int:
        return hash((id(self.gemms), self.dtype))

    def pack(self, shard: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(this rank's FP8 shard as uint8 bytes, the scale)``: the amax all-reduced over Z
        and the tensor axes."""
        g = self.gemms
        axes = (Axis.Z, g.out_axis, g.in_axis)
        t = shard.detach().to(self.dtype)
        w8 = g.cast(t, g.config.cast_config_weight, g.WEIGHT, 0, axes)
        return w8._data.view(torch.uint8), w8._scale

    def unpack(self, gathered: torch.Tensor, scale: torch.Tensor):
        """The gathered bytes ``[n/G_out, k/G_in]`` as the FP8 weight."""
        g = self.gemms
        dtype = g.config.cast_config_weight.target_dtype
        return g.ao.tensor.Float8TrainingTensor(
            gathered.view(dtype), scale, self.dtype, g.mm_config, g.WEIGHT
        )
