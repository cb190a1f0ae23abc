"""The numeric-format policy: which dtype every tensor of a training step has, decided once, for
the runtime and the planner (plain Python; :mod:`tetrad.dtypes` gives it in torch terms).

A :class:`Precision` names the format of each kind of tensor; :func:`precision` returns the
policy of a device. Today's policies:

| tensor                                   | ``cpu``  | ``cuda`` |
| ---------------------------------------- | -------- | -------- |
| GEMMs and attention (``compute``)        | fp32     | bf16 (autocast) |
| parameters as stored (``params``)        | fp32     | fp32     |
| master weights in the optimizer          | fp32     | fp32     |
| gradients and their reductions (``grads``) | fp32   | fp32     |
| AdamW states (``optimizer_states``)      | fp32     | fp32     |
| residual stream between blocks           | fp32     | fp32     |
| pipeline stage boundaries                | fp32     | bf16     |
| norm statistics, softmax, loss           | fp32     | fp32     |
| FP8 GEMMs (``fp8``)                      | off      | off      |

Storing weights in the compute dtype with fp32 masters in the optimizer, the residual stream in
the compute dtype, and FP8 GEMM recipes plug in here: a layer never decides a dtype itself, it
reads the policy (through :func:`tetrad.dtypes.compute_dtype` and :func:`tetrad.dtypes.autocast`).
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

FP8_RECIPES = ("off",)
"""FP8 GEMM scaling recipes the runtime implements (``off`` only, so far)."""


RUNTIME_TIES = {
    "stage_boundary": "compute",
    "residual": "params",
    "master": "params",
    "grads": "params",
    "optimizer_states": "params",
}
"""Formats the runtime ties together today: a stage sends in the format its GEMMs produce
(:func:`tetrad.dtypes.compute_dtype` under the step's autocast), the residual stream adds in
the parameters' format, and the optimizer updates the stored parameters in place, so masters,
gradients and AdamW states are the parameters' format. Weights stored in the compute format
with fp32 masters, and an fp32 boundary under bf16 compute, untie them."""


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
        grads: gradients as accumulated and as reduced over the data, Z and tensor axes.
        optimizer_states: AdamW's first and second moments.
        residual: the residual stream between blocks.
        stage_boundary: activations (and their gradients) sent between pipeline stages.
        statistics: norm statistics, the softmax and the loss.
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

    @property
    def autocast(self) -> bool:
        """Whether GEMMs run under autocast (their compute dtype is not the parameters')."""
        return self.compute != self.params

    def bytes(self, kind: str) -> int:
        """Bytes per element of the tensors of ``kind`` (a field name: ``compute``,
        ``grads``...)."""
        return DTYPE_BYTES[getattr(self, kind)]


def precision(device: str) -> Precision:
    """The numeric-format policy of the runtime on ``device``: fp32 everywhere on the CPU; on
    CUDA, bf16 GEMMs and attention under autocast and bf16 stage boundaries (Megatron-LM's
    activations), everything else fp32."""
    if device == "cuda":
        return Precision(compute="bf16", stage_boundary="bf16")
    return Precision()


def compute_dtype(device: str) -> str:
    """The compute dtype of the runtime on ``device``: ``precision(device).compute``."""
    return precision(device).compute
