"""Counting the collectives of stock PyTorch: a ``TorchDispatchMode`` that sees every c10d op
(plain ``dist.*``, DDP's reducer, FSDP2, and the point-to-point ``c10d::send`` and
``c10d::recv_`` that ``torch.distributed.pipelining`` issues through ``batch_isend_irecv``: the
process group calls them through the dispatcher, gloo included) and every functional collective
(DTensor redistributions, ``loss_parallel``) after DTensor has lowered itself to plain tensors,
and sums their calls and payload bytes per kind (``benchmarks/vs_pytorch.py`` states the
payload convention; a point-to-point transfer's bytes count at the sender only)."""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_KINDS = (
    ("reduce_scatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("all_reduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("all_gather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("all_to_all", "all_to_all"),
    ("broadcast", "broadcast"),
    ("send", "send"),
    ("recv", "recv"),
    ("scatter", "scatter"),
    ("gather", "gather"),
    ("reduce", "reduce"),
)
"""Substring of an op name -> collective kind, first match wins."""

RECEIVES = frozenset({"recv"})
"""Point-to-point receives: counted in calls, not in bytes (a transfer's bytes are the
sender's ``send``)."""


def collective_kind(op: torch._ops.OpOverload) -> str | None:
    """The kind of a c10d or functional collective op (``all_reduce``, ...), else ``None``."""
    namespace, _, name = op.name().partition("::")
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    return next((kind for key, kind in _KINDS if key in name), None)


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def payload_bytes(op: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object) -> int:
    """The larger of a collective's input and output buffers. A c10d op names its outputs
    ``output*`` (an in-place op's tensors are both); a functional op returns its output (an
    ``*_out`` variant also takes it as ``out``)."""
    names = [a.name for a in op._schema.arguments]
    given = dict(zip(names, args, strict=False)) | kwargs
    inputs = sum(_nbytes(v) for k, v in given.items() if not k.startswith("out"))
    outputs = sum(_nbytes(v) for k, v in given.items() if k.startswith("out"))
    if op.namespace == "_c10d_functional" and "out" not in given:
        outputs += _nbytes(out)
    return max(inputs, outputs)


class CollectiveCounter(TorchDispatchMode):
    """Counts the calls and payload bytes, per kind, of the collectives issued while active.

    DTensor operations are passed on (``NotImplemented``) so that DTensor lowers them to plain
    tensors; the collectives that produces come back here.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not isinstance(func, torch._ops.OpOverload):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        kind = collective_kind(func)
        if kind is not None:
            self.calls[kind] += 1
            if kind not in RECEIVES:
                self.bytes[kind] += payload_bytes(func, args, kwargs, out)
        return out
