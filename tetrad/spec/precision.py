"""The numeric-format policy: which dtype every tensor of a training step has, decided once, for
the runtime and the planner (plain Python; :mod:`tetrad.dtypes` gives it in torch terms).

A :class:`Precision` names the format of each kind of tensor; :func:`precision` returns the
policy of a device. Today's policies:

| tensor                                   | ``cpu``  | ``cuda`` |
| ---------------------------------------- | -------- | -------- |
| GEMMs and attention (``compute``)        | fp32     | bf16 (autocast) |
| parameters as stored (``params``)        | fp32     | fp32     |
| master weights in the optimizer          | fp32     | fp32     |
| gradients as accumulated (``grads``)     | fp32     | fp32     |
| their sum over data (``grad_reduce``)    | fp32     | fp32     |
| AdamW states (``optimizer_states``)      | fp32     | fp32     |
| residual stream between blocks           | fp32     | bf16     |
| pipeline stage boundaries                | fp32     | bf16     |
| norm statistics, softmax, loss           | fp32     | fp32     |
| FP8 GEMMs of the block Linears (``fp8``) | off      | off      |

``params="bf16"`` (``tetrad train --param-dtype bf16``) stores the weights in bf16 with fp32
masters in the optimizer (Megatron-LM's mixed precision: Narayanan et al., arXiv 2104.04473,
and its distributed optimizer, whose masters are sharded over data x context with
``--shard-optimizer``): forward and backward read the bf16 weights, the gradients accumulate in
fp32 (Megatron's ``main_grad``), AdamW updates the fp32 masters and the bf16 weights are
refreshed from them after every step. The GEMMs then run in bf16 on every device (on the CPU
too, under the CPU's bf16 autocast: a single-process reference under the same policy computes
in the same formats). ``grad_reduce="bf16"`` (``--grad-reduce-dtype bf16``) sums the fp32
gradients over data in bf16.

The residual stream (``residual``, ``--residual-dtype``): by default (``auto``) in the compute
format, as Megatron-LM keeps its activations (bf16 wherever the GEMMs are bf16: on CUDA, and
with bf16 weights on any device), so the embedding's output, the residual adds, the blocks'
outputs, the norms' inputs and outputs and the head's input are bf16, and a stage boundary
needs no cast; ``fp32`` keeps an fp32 stream (each block's output is its bf16 branch added to
the fp32 stream). The norms' statistics stay fp32 (``statistics``) either way.

FP8 GEMM recipes plug in here too: a layer never decides a dtype itself, it reads the policy
(through :func:`tetrad.dtypes.compute_dtype`, :func:`tetrad.dtypes.residual_dtype` and
:func:`tetrad.dtypes.autocast`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tetrad.spec.errors import TetradError
from tetrad.spec.units import FP32

Device = Literal["cpu", "cuda"]
DEVICES: tuple[Device, ...] = ("cpu", "cuda")
"""``cpu`` runs on gloo in fp32; ``cuda`` on NCCL with bf16 autocast."""

DTYPE_BYTES = {"bf16": 2, "fp32": FP32}
"""Bytes per element of each format name."""

FP8_RECIPES = ("off", "tensorwise", "rowwise")
"""FP8 GEMM scaling recipes (``--fp8``; torchao.float8's recipes of the same names): ``off``,
``tensorwise`` (one dynamic scale per tensor), ``rowwise`` (a scale per row of the activations
and per output feature of the weights)."""


def fp8_converts(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether ``recipe`` runs a block Linear of full weight ``[out_features, in_features]`` in
    FP8: ``tensorwise`` every one; ``rowwise`` those torchao's auto filter
    (``torchao/float8/float8_linear_utils.py``) keeps, not when ``N <= 2048``, ``K <= 1024`` or
    ``N <= 4096 and K <= 2048`` (small GEMMs lose more to the casts than they gain); ``off``
    none. The embedding, the LM head, the MoE router and experts and the norms stay in the
    compute dtype under every recipe."""
    if recipe == "tensorwise":
        return True
    if recipe != "rowwise":
        return False
    n, k = out_features, in_features
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


RUNTIME_TIES = {"stage_boundary": "compute"}
"""Formats the runtime ties together today: a stage sends in the format its GEMMs produce
(:func:`tetrad.dtypes.compute_dtype` under the step's autocast). An fp32 boundary under bf16
compute unties them."""

RUNTIME_FP32 = ("master", "grads", "optimizer_states", "statistics")
"""Formats the runtime keeps in fp32 whatever the stored weights: the optimizer's masters, the
accumulated gradients (Megatron's ``main_grad``), AdamW's moments, and the norms' statistics,
the softmax and the loss."""

PARAM_DTYPES = ("fp32", "bf16")
"""Formats the weights may be stored in (``--param-dtype``)."""

RESIDUAL_DTYPES = ("auto", "fp32", "bf16")
"""Formats of the residual stream (``--residual-dtype``); ``auto``: the compute format."""


class PrecisionError(TetradError):
    """A numeric format that is not one of :data:`DTYPE_BYTES` (or an FP8 recipe not in
    :data:`FP8_RECIPES`)."""


@dataclass(frozen=True)
class Precision:
    """The numeric formats of one run's training step, each a name of :data:`DTYPE_BYTES`.

    Attributes:
        compute: GEMM and attention inputs (``bf16``: under autocast, the weights are cast as
            each GEMM reads them; ``fp32``: no autocast).
        params: the parameters as the model stores them.
        master: the optimizer's copy of the weights it updates.
        grads: gradients as accumulated over micro-batches and as reduced over the Z and
            tensor axes.
        optimizer_states: AdamW's first and second moments.
        residual: the residual stream between blocks.
        stage_boundary: activations (and their gradients) sent between pipeline stages.
        statistics: norm statistics, the softmax and the loss.
        grad_reduce: gradients as summed over data x context (all-reduce or, with the sharded
            optimizer, reduce-scatter); the sums are accumulated back in ``grads``.
        fp8: the FP8 GEMM scaling recipe (:data:`FP8_RECIPES`; ``off``: none).

    Raises:
        PrecisionError: an unknown format name.
    """

    compute: str = "fp32"
    params: str = "fp32"
    master: str = "fp32"
    grads: str = "fp32"
    optimizer_states: str = "fp32"
    residual: str = "fp32"
    stage_boundary: str = "fp32"
    statistics: str = "fp32"
    grad_reduce: str = "fp32"
    fp8: str = "off"

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name == "fp8":
                if value not in FP8_RECIPES:
                    raise PrecisionError(f"fp8={value!r} is not one of {', '.join(FP8_RECIPES)}")
            elif value not in DTYPE_BYTES:
                raise PrecisionError(
                    f"{name}={value!r} is not a numeric format: use {' or '.join(DTYPE_BYTES)}"
                )
        for name, same in RUNTIME_TIES.items():
            if getattr(self, name) != getattr(self, same):
                raise PrecisionError(
                    f"{name}={getattr(self, name)} with {same}={getattr(self, same)}: the "
                    f"runtime keeps {name} in the {same} format"
                )
        for name in RUNTIME_FP32:
            if getattr(self, name) != "fp32":
                raise PrecisionError(
                    f"{name}={getattr(self, name)}: the runtime keeps {name} in fp32"
                )
        if self.params == "bf16" and self.compute != "bf16":
            raise PrecisionError(
                f"compute={self.compute} with params=bf16: weights stored in bf16 compute in bf16"
            )
        if self.residual == "bf16" and self.compute != "bf16":
            raise PrecisionError(
                f"residual=bf16 with compute={self.compute}: a bf16 residual stream needs bf16 "
                "compute (bf16 weights, or cuda)"
            )

    @property
    def masters(self) -> bool:
        """Whether the optimizer keeps master weights apart from the stored ones (their
        formats differ: ``params="bf16"``); gradients then accumulate apart too."""
        return self.params != self.master

    @property
    def autocast(self) -> bool:
        """Whether the step runs under autocast: its GEMMs compute in a narrower format than
        the statistics (bf16 against fp32), whatever the residual stream's format."""
        return self.compute != self.statistics

    def bytes(self, kind: str) -> int:
        """Bytes per element of the tensors of ``kind`` (a field name: ``compute``,
        ``grads``...)."""
        return DTYPE_BYTES[getattr(self, kind)]


def precision(
    device: str,
    params: str = "fp32",
    grad_reduce: str = "fp32",
    residual: str = "auto",
    fp8: str = "off",
) -> Precision:
    """The numeric-format policy of the runtime on ``device``.

    With fp32 weights (``params``, the default): fp32 everywhere on the CPU; on CUDA, bf16 GEMMs
    and attention under autocast, a bf16 residual stream and bf16 stage boundaries
    (Megatron-LM's activations), everything else fp32. With bf16 weights: bf16 GEMMs under
    autocast, residual stream and stage boundaries on every device; fp32 masters, gradients
    and AdamW states. ``grad_reduce``: the format of the gradients' sum over data.
    ``residual``: the residual stream's format, ``auto`` (the compute format), ``fp32``, or
    ``bf16`` (where the compute format is bf16). ``fp8``: the block Linears' FP8 GEMM recipe
    (:data:`FP8_RECIPES`; their inputs and outputs stay in the compute format).

    Raises:
        PrecisionError: ``params`` or ``grad_reduce`` not ``fp32`` or ``bf16``, ``residual``
            not one of :data:`RESIDUAL_DTYPES`, ``bf16`` with fp32 compute, or ``fp8`` not one
            of :data:`FP8_RECIPES`.
    """
    if params not in PARAM_DTYPES:
        raise PrecisionError(f"param dtype {params!r}: use {' or '.join(PARAM_DTYPES)}")
    if grad_reduce not in DTYPE_BYTES:
        raise PrecisionError(f"grad-reduce dtype {grad_reduce!r}: use {' or '.join(DTYPE_BYTES)}")
    if residual not in RESIDUAL_DTYPES:
        raise PrecisionError(
            f"residual dtype {residual!r}: use {', '.join(RESIDUAL_DTYPES)} (auto: the compute "
            "dtype)"
        )
    compute = "bf16" if device == "cuda" or params == "bf16" else "fp32"
    if residual == "bf16" and compute != "bf16":
        raise PrecisionError(
            f"residual dtype bf16 on {device} with {params} weights computes in fp32: use "
            "--param-dtype bf16 (or cuda), or --residual-dtype auto or fp32"
        )
    return Precision(
        compute=compute,
        params=params,
        residual=compute if residual == "auto" else residual,
        stage_boundary=compute,
        grad_reduce=grad_reduce,
        fp8=fp8,
    )


def compute_dtype(device: str, params: str = "fp32") -> str:
    """The compute dtype of the runtime on ``device`` with weights stored in ``params``:
    ``precision(device, params).compute``."""
    return precision(device, params).compute
