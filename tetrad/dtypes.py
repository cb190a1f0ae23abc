"""The numeric-format policy (:mod:`tetrad.spec.precision`) in torch terms: the one place the
step's dtypes are read. Layers never pick a dtype of their own: a GEMM runs in
:func:`compute_dtype`, the step enters :func:`autocast` (which also makes its policy the one
:func:`residual_dtype` reads), and the other tensors take the policy's formats through
:func:`torch_dtype`. :func:`keep_policy` records a run's policy on its model's parameters, where
:func:`stored_policy` finds it."""

from __future__ import annotations

import contextlib
import contextvars

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


_ACTIVE: contextvars.ContextVar[Precision | None] = contextvars.ContextVar(
    "tetrad_policy", default=None
)
"""The policy of the :func:`autocast` context the current forward runs in (None: none)."""


def keep_policy(model: torch.nn.Module, policy: Precision) -> None:
    """Record ``policy`` on each of ``model``'s parameters (``param.policy``), for
    :func:`stored_policy`: a run's choices that its weights' dtypes do not tell (the residual
    stream's format). :func:`tetrad.train.step.build_optimizer` calls it with the run's
    policy."""
    for p in model.parameters():
        p.policy = policy


def stored_policy(model: torch.nn.Module, device: torch.device | str) -> Precision:
    """The policy of the runtime on ``device`` for ``model``: the one :func:`keep_policy`
    recorded on its parameters, else :func:`tetrad.spec.precision.precision` with ``params``
    the format of its parameters as stored (bf16 once
    :func:`tetrad.parallel.masters.store_parameters` cast them) and the other choices at their
    defaults."""
    p = next(iter(model.parameters()), None)
    kept = getattr(p, "policy", None)
    names = {v: k for k, v in TORCH_DTYPES.items()}
    params = names.get(p.dtype, "fp32") if p is not None else "fp32"
    if kept is not None and kept.params == params:
        return kept
    return precision(torch.device(device).type, params)


def policy_of(device: torch.device | str) -> Precision:
    """The numeric-format policy of the runtime on ``device``
    (:func:`tetrad.spec.precision.precision` of its type)."""
    return precision(torch.device(device).type)


def residual_dtype(device: torch.device | str, weights: torch.dtype) -> torch.dtype:
    """The residual stream's dtype on ``device`` for weights stored as ``weights``: the
    ``residual`` format of the policy whose :func:`autocast` the forward runs in (bf16 or fp32,
    ``--residual-dtype``), fp32 outside one (a forward under plain ``torch.autocast`` or none),
    or the weights' own dtype where it is wider than fp32 (float64 weights, as the float64
    tests run, keep a float64 stream). The embedding's output and a received pipeline stage
    input are cast to it; the residual adds and the blocks' outputs follow it."""
    active = _ACTIVE.get()
    name = active.residual if active is not None else "fp32"
    if weights.itemsize > torch.float32.itemsize:
        return torch.promote_types(torch_dtype(name), weights)
    return torch_dtype(name)


def fp8_recipe() -> str:
    """The FP8 GEMM recipe of the policy whose :func:`autocast` the forward runs in (``off``
    outside one): :mod:`tetrad.parallel.fp8`."""
    active = _ACTIVE.get()
    return active.fp8 if active is not None else "off"


def recompute_context() -> tuple[contextlib.AbstractContextManager, ...]:
    """``torch.utils.checkpoint``'s ``context_fn`` for a block recomputed in backward: the
    forward runs as it is, the recomputation under the policy active now (the backward runs
    outside the step's :func:`autocast`, on the engine's thread, where the policy that
    :func:`fp8_recipe` reads is not set: without this a block would recompute its Linears
    without their FP8 casts). torch restores autocast itself."""
    policy = _ACTIVE.get()
    again = _active(policy) if policy is not None else contextlib.nullcontext()
    return contextlib.nullcontext(), again


@contextlib.contextmanager
def _active(policy: Precision):
    """Make ``policy`` the one :func:`residual_dtype` reads while active."""
    token = _ACTIVE.set(policy)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


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
    dtype where it is bf16 (on CUDA, and on the CPU with bf16 weights), none where it is fp32
    (on the CPU); inside it :func:`residual_dtype` gives the policy's residual stream format.
    On CUDA, attention is also restricted to the flash kernels (FlashAttention-2's or
    cuDNN's), so that a shape they do not cover fails loudly instead of falling back to the
    slow math kernel.

    Args:
        device: where the step runs.
        policy: the formats (default: :func:`policy_of` ``device``).
    """
    policy = policy or policy_of(device)
    stack = contextlib.ExitStack()
    stack.enter_context(_active(policy))
    if not policy.autocast:
        return stack
    stack.enter_context(torch.autocast(device.type, dtype=torch_dtype(policy.compute)))
    if device.type == "cuda":
        stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]))
    return stack
