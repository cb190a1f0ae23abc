"""The numeric-format policy (:mod:`tetrad.spec.precision`) in torch terms: the one place the
step's dtypes are read. Layers never pick a dtype of their own: a GEMM runs in
:func:`compute_dtype`, the step enters :func:`autocast`, and the other tensors take the
policy's formats through :func:`torch_dtype`."""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tetrad.spec.precision import Precision, precision

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
"""The torch dtype of each format name of :data:`tetrad.spec.precision.DTYPE_BYTES`."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of the format ``name`` (``bf16``, ``fp32``).

    Raises:
        KeyError: a name that is not a format.
    """
    return TORCH_DTYPES[name]


def stored_policy(model: torch.nn.Module, device: torch.device | str) -> Precision:
    """The policy of the runtime on ``device`` for ``model``'s weights as they are stored
    (:func:`tetrad.spec.precision.precision` with ``params`` the format of its parameters:
    bf16 once :func:`tetrad.parallel.masters.store_parameters` cast them)."""
    p = next(iter(model.parameters()), None)
    names = {v: k for k, v in TORCH_DTYPES.items()}
    params = names.get(p.dtype, "fp32") if p is not None else "fp32"
    return precision(torch.device(device).type, params)


def policy_of(device: torch.device | str) -> Precision:
    """The numeric-format policy of the runtime on ``device``
    (:func:`tetrad.spec.precision.precision` of its type)."""
    return precision(torch.device(device).type)


def residual_dtype(device: torch.device | str, weights: torch.dtype) -> torch.dtype:
    """The residual stream's dtype on ``device`` for weights stored as ``weights``: the
    policy's ``residual`` (fp32, also with bf16 weights), or the weights' own dtype where it is
    wider (float64 weights, as the float64 tests run, keep a float64 stream); the embedding's
    output is cast to it."""
    return torch.promote_types(torch_dtype(policy_of(device).residual), weights)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on ``x`` runs in now: the autocast dtype where the step's
    :func:`autocast` is on for ``x``'s device, else ``x``'s own."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def autocast(
    device: torch.device, policy: Precision | None = None
) -> contextlib.AbstractContextManager:
    """The context every forward of a training step runs in: autocast to the policy's compute
    dtype where it differs from the residual stream's (bf16 on CUDA, and on the CPU with bf16
    weights), nothing where it does not (fp32 on the CPU). On CUDA, attention is also
    restricted to the flash kernels (FlashAttention-2's or cuDNN's), so that a shape they do
    not cover fails loudly instead of falling back to the slow math kernel.

    Args:
        device: where the step runs.
        policy: the formats (default: :func:`policy_of` ``device``).
    """
    policy = policy or policy_of(device)
    if not policy.autocast:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast(device.type, dtype=torch_dtype(policy.compute)))
    if device.type == "cuda":
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]))
    return stack
