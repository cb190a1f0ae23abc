"""Every private torch API tetrad uses, in one place.

torch's public API offers none of these. Each works on every torch tetrad supports, from the
minimum in ``pyproject.toml`` (2.11, the GPU images' version) to the one ``make test`` installs
(2.13): ``make test-torch-min`` runs the tests that touch them (``tests/test_torch_private.py``)
on the minimum. When torch changes one, this file is the one to change.

- ``DeviceMesh._flatten``: one process group over several mesh dimensions
  (:func:`flatten_mesh`; the data x context group).
- ``DeviceMesh(..., _init_backend=False)``: a mesh without process groups, for DTensors that
  only describe a layout (:func:`layout_mesh`; the checkpointer's).
- ``torch._foreach_norm``, ``torch._foreach_mul_``, ``torch._foreach_copy_``: one kernel per
  list of tensors, as ``torch.nn.utils.clip_grad_norm_`` uses them (:func:`foreach_norm`,
  :func:`foreach_mul_`, :func:`foreach_copy_`).
- ``torch._dynamo.utils.counters``: the graphs and graph breaks compiled so far
  (:func:`dynamo_counts`).
- ``torch._assert_async``: a check of a device tensor that raises without the host waiting for
  the device (:func:`check_on_device`).
- ``torch.Tensor._make_subclass`` (as ``nn.Parameter`` uses it): a
  :class:`~torch.nn.attention.bias.CausalBias` without storage (:func:`lower_right_causal`).
- ``PipelineStage``'s receive-buffer internals (``args_recv_info``, ``grad_recv_info``, the
  ``_RecvInfo`` buffers, ``_setup_forward_recv_info``, ``_setup_backward_recv_info``,
  ``_post_metadata_inference_cleanup``): :class:`LeanRecvStage`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.nn.attention.bias import CausalBias, CausalVariant


def flatten_mesh(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """The 1D mesh over the dimensions ``dims`` of ``mesh`` (ranks in row-major order of
    ``dims``), named ``name``; its ``get_group()`` is one process group over them. Collective:
    every rank of ``mesh`` calls it at once."""
    return mesh[dims]._flatten(name)


def layout_mesh(device_type: str, ranks: torch.Tensor, names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over ``ranks`` named ``names`` that creates no process group: enough for
    DTensors that only say which piece of a tensor a rank holds (DCP plans and reads with its
    own group). Not collective."""
    return DeviceMesh(device_type, ranks, mesh_dim_names=names, _init_backend=False)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, as 0-dim tensors of its dtype (one kernel per list)."""
    return list(torch._foreach_norm(tensors))


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply every tensor in place by the 0-dim ``scale`` (one kernel, no host read)."""
    torch._foreach_mul_(tensors, scale)


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every ``i`` (casting to each target's dtype)."""
    torch._foreach_copy_(targets, sources)


def dynamo_counts() -> dict[str, int]:
    """``{"graphs": ..., "graph_breaks": ...}`` that torch.compile made so far in this
    process."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def check_on_device(condition: torch.Tensor, message: str) -> None:
    """Fail where the 0-dim bool ``condition`` is false, without a host read: on CPU at once
    (``RuntimeError(message)``); on CUDA a device-side assertion, which leaves the process's
    CUDA context unusable (the job stops; the other ranks at their collectives' timeout). A
    guard against a broken contract, not a recoverable error."""
    torch._assert_async(condition, message)


SHAPES_INFERRED_BY_A_REAL_STEP = hasattr(PipelineStage, "_post_metadata_inference_cleanup")
"""Whether ``PipelineStage`` infers its boundary shapes with a real forward and backward
(torch 2.13) rather than on the meta device (torch 2.11): only then does
:meth:`LeanRecvStage.after_shape_inference` run."""


class _LowerRightCausal(CausalBias):
    """:class:`CausalBias` of the lower-right variant whose tensor holds no elements."""

    def __new__(cls, seq_len_q: int, seq_len_kv: int):
        return torch.Tensor._make_subclass(cls, torch.empty(0))

    def __init__(self, seq_len_q: int, seq_len_kv: int):
        super().__init__(CausalVariant.LOWER_RIGHT, seq_len_q, seq_len_kv)


def lower_right_causal(seq_len_q: int, seq_len_kv: int) -> CausalBias:
    """torch's ``causal_lower_right(seq_len_q, seq_len_kv)`` without its storage.
    ``CausalBias`` has no ``__new__``, so ``torch.Tensor``'s legacy constructor reads its
    arguments as sizes and allocates an uninitialised fp32 host tensor ``[2, q, kv]`` that
    nothing reads (the bias dispatches on its variant and lengths): 32 GiB for one chunk of a
    262,144-token sequence on ``G_context = 8``, which a host without overcommit refuses."""
    return _LowerRightCausal(seq_len_q, seq_len_kv)


class LeanRecvStage(PipelineStage):
    """``PipelineStage`` that holds receive buffers only for the micro-batches in flight.

    torch allocates one buffer per micro-batch and direction when the schedule starts and
    keeps them for the run (``m`` activations and ``m`` gradients per stage); this stage
    allocates each when its receive is posted and releases it after the micro-batch's backward
    (after its forward when no backward follows: evaluation), so a stage holds the inputs of
    the passes in flight, as the schedule's memory model counts them. Subclasses override
    :meth:`after_shape_inference` instead of torch's cleanup hook.

    With :attr:`post_ahead` set (its owner's choice: gloo groups, one stage per rank, a schedule
    that runs each direction's passes in micro-batch order: GPipe and 1F1B), a step's first
    receive of a direction posts that direction's receives of every micro-batch at once, and
    each pass waits for its own. On gloo a receive posted after the sender's notice makes
    the peer answer at once, while the posting thread still holds the connection's lock; on
    cores shared with compute the connection's event thread is woken onto the poster's core and
    spins on that lock (``gloo/transport/tcp/pair.cc``, ``Pair::handleEvents``'s try-lock),
    about 5 ms a receive on 2 cores, where a receiver that lags its sender pays it for every
    micro-batch. Posted before the sender sends, the data arrives while the lock is free. The
    buffers of a GPipe step's forward receives are all alive at its peak in any case; posting
    the gradients' ahead keeps up to ``m - 1`` more of them during the backward. Under 1F1B a
    stage holds up to ``m`` buffers per direction where torch's posting holds the passes in
    flight (a CPU rank's boundary tensors: 512 KiB each for the demo's sizes).
    """

    post_ahead = False
    """Post each direction's receives of a step at its first (see above)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._posted: dict[str, dict[int, list[dist.Work]]] = {"fwd": {}, "bwd": {}}

    def after_shape_inference(self) -> None:
        """Called once after the first step's shape inference where that is a real forward
        and backward (:data:`SHAPES_INFERRED_BY_A_REAL_STEP`), whose gradients, unlike FSDP
        modules', torch leaves in the parameters."""

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        self.after_shape_inference()

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        super()._setup_forward_recv_info(num_microbatches, has_backward)
        for infos in self.args_recv_info.values():
            _release(infos)

    def _setup_backward_recv_info(self, num_microbatches: int) -> None:
        super()._setup_backward_recv_info(num_microbatches)
        for infos in self.grad_recv_info.values():
            _release(infos)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.post_ahead and not self.is_first:
            return self._posted_ahead("fwd", fwd_chunk_id, self._fwd_recv_ops)
        return self._fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.post_ahead and self.has_backward and not self.is_last:
            return self._posted_ahead("bwd", bwd_chunk_id, self._bwd_recv_ops)
        return self._bwd_recv_ops(bwd_chunk_id)

    def _fwd_recv_ops(self, chunk: int) -> list[dist.P2POp]:
        _allocate(self.args_recv_info[chunk], self.device)
        return PipelineStage.get_fwd_recv_ops(self, chunk)

    def _bwd_recv_ops(self, chunk: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[chunk], self.device)
        return PipelineStage.get_bwd_recv_ops(self, chunk)

    def _posted_ahead(self, direction: str, chunk: int, ops_of) -> list[dist.P2POp]:
        """No receive for the schedule to post: at micro-batch 0 every micro-batch's are
        posted here (in micro-batch order, the order the peer sends them), and each pass waits
        for its own (:meth:`_wait_posted`)."""
        posted = self._posted[direction]
        if chunk == 0 and not posted:
            for i in range(self.chunks):
                posted[i] = [_irecv(op) for op in ops_of(i)]
        if chunk in posted:
            return []
        return ops_of(chunk)  # not posted ahead: as torch does

    def _wait_posted(self, direction: str, chunk: int) -> None:
        for work in self._posted[direction].pop(chunk, ()):
            work.wait()

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs=None, *rest: Any, **kw):
        self._wait_posted("fwd", fwd_chunk_id)
        if torch.is_grad_enabled():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **kw)
        try:  # evaluation: no backward will release the input
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **kw)
        finally:
            _release(self.args_recv_info[fwd_chunk_id])

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward=True, last_backward=False
    ):
        self._wait_posted("bwd", bwd_chunk_id)
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        finally:
            _release(self.args_recv_info[bwd_chunk_id])
            _release(self.grad_recv_info.get(bwd_chunk_id, ()))

    def recv_buffers(self) -> list[torch.Tensor]:
        """The receive buffers this stage holds now (activations and gradients; a released
        one is an empty tensor)."""
        infos = [*self.args_recv_info.values(), *self.grad_recv_info.values()]
        return [
            b for group in infos for i in group if (b := getattr(i, "buffer", None)) is not None
        ]


def _irecv(op: dist.P2POp) -> dist.Work:
    """Post ``op``'s receive now, as torch's schedules post a batch of receives alone."""
    return dist.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)


def _release(infos: Iterable) -> None:
    """Drop the receive buffers of one micro-batch's ``_RecvInfo``s, remembering each one's
    layout (an empty tensor of the same dtype stands in: ``None`` means "no tensor expected"
    to torch). A root argument has no buffer (torch 2.13: ``None``; 2.11: a placeholder
    without the attribute)."""
    for info in infos:
        buffer = getattr(info, "buffer", None)
        if buffer is not None and buffer.numel():
            info.tetrad_layout = (buffer.shape, buffer.stride(), buffer.dtype, buffer.requires_grad)
            info.buffer = buffer.new_empty(0)


def _allocate(infos: Iterable, device: torch.device) -> None:
    """Give each released receive buffer of one micro-batch its tensor again (the layout and
    ``requires_grad`` it had when released: torch 2.11 sets it on the buffers it makes), before
    its receive is posted."""
    for info in infos:
        layout = getattr(info, "tetrad_layout", None)
        if layout is not None and not info.buffer.numel():
            shape, stride, dtype, requires_grad = layout
            buffer = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            info.buffer = buffer.requires_grad_(requires_grad)
