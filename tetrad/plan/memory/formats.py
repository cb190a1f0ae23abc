"""The memory model's numeric formats: bytes per element of the compute dtype
(:data:`tetrad.spec.precision.DTYPE_BYTES`) and of the residual stream (``tetrad train
--residual-dtype``), with the errors that name what to change."""

from __future__ import annotations

from tetrad.plan.errors import PlanError
from tetrad.spec.precision import DTYPE_BYTES


def dtype_bytes(dtype: str) -> int:
    """Bytes of the compute dtype ``dtype`` (:data:`tetrad.spec.precision.DTYPE_BYTES`).

    Raises:
        PlanError: an unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"dtype {dtype!r} is unknown: use 'bf16' (CUDA) or 'fp32' (CPU)")
    return DTYPE_BYTES[dtype]


def residual_bytes(dtype: str, residual: str | None) -> int:
    """Bytes per element of the residual stream: ``residual`` (``fp32`` or ``bf16``), or with
    None (``--residual-dtype auto``) the compute dtype ``dtype``'s.

    Raises:
        PlanError: an unknown dtype, or a bf16 stream under fp32 compute (the runtime refuses
            it).
    """
    if residual is None:
        return dtype_bytes(dtype)
    if dtype_bytes(residual) < dtype_bytes(dtype):
        raise PlanError(f"residual={residual} with dtype={dtype}: a bf16 stream needs bf16 compute")
    return dtype_bytes(residual)


def residual_option(dtype: str, residual: str | None) -> str | None:
    """``--residual-dtype`` (``auto``, ``fp32`` or ``bf16``) as the ``residual`` keyword of the
    memory model: None for ``auto`` and for the compute dtype ``dtype``'s own format (the same
    bytes: one memo key), else ``residual``.

    Raises:
        PlanError: an unknown format, or a bf16 stream under fp32 compute.
    """
    if residual in (None, "auto"):
        return None
    residual_bytes(dtype, residual)  # checks it
    return None if residual == dtype else residual
