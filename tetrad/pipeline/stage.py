"""A pipeline stage of tetrad's parallel Llama for ``torch.distributed.pipelining``.

Each stage is a :class:`~tetrad.models.llama.ModelPart` of the model built on the stage's own
5D grid (everything within a stage is as without a pipeline). The schedule runs a micro-batch's
forward and backward apart (1F1B interleaves them), so the stage tells the model's
:class:`~tetrad.parallel.overlap.Overlap` which phase runs: its Z all-gathers are recorded and
prefetched per phase, and the data-parallel buckets fill during the stage's last backward, so
gradient reductions start as soon as the stage's share of the backward ends (overlapped with the
other stages' cool-down).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tetrad.comm import count_sends
from tetrad.dtypes import compute_dtype, residual_dtype
from tetrad.models.llama import Transformer
from tetrad.parallel.experts import biased_routers
from tetrad.parallel.masters import drop_grads
from tetrad.spec.grid import Axis
from tetrad.torch_private import LeanRecvStage


class StageForward(nn.Module):
    """The stage's computation as ``PipelineStage`` calls it: ``x`` -> ``part.hidden(x)``.

    ``x``: token ids ``[b, S/G_context]`` on the first stage, else the residual stream
    ``[b, S/G_context, h/G_x]``; returns the residual stream, or on the last stage the final
    norm's output (the LM head and loss run in the schedule's ``loss_fn``).

    The residual stream crosses a stage boundary in the policy's ``stage_boundary`` format,
    its compute format (:mod:`tetrad.spec.precision`): what the step's autocast gives the
    GEMMs (bf16 on CUDA, as Megatron-LM's activations: half the point-to-point bytes of fp32;
    fp32 on CPU). It continues in the ``residual`` format on the next stage
    (:func:`tetrad.dtypes.residual_dtype`: the same bf16 by default, no cast).

    Args:
        part: the stage's model part.
        sends: whether the output goes to a next stage (every stage but the last).
    """

    def __init__(self, part: Transformer, sends: bool = True):
        super().__init__()
        self.part, self.sends = part, sends
        self.aux_scale = 0.0  # 1 / global sequences, set by the Pipeline before a step
        self.aux_total: torch.Tensor | float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():  # the residual stream, received in the boundary format
            x = x.to(residual_dtype(x.device, next(self.part.parameters()).dtype))
        h = self.part.hidden(x)
        aux = self.part.aux_loss_sum() if self.aux_scale and torch.is_grad_enabled() else None
        if self.aux_scale and torch.is_grad_enabled():  # MoE loads, summed on the device
            self.part.record_routing()
        if aux is not None:  # the stage's MoE load-balancing terms, differentiated in place
            aux = aux * self.aux_scale
            self.aux_total = self.aux_total + aux.detach()
            h = AttachAux.apply(h, aux)
        return h.to(compute_dtype(h)) if self.sends else h


class AttachAux(torch.autograd.Function):
    """``(h, aux)`` -> ``h``, whose backward also gives ``aux`` the gradient 1: the stage's
    load-balancing terms join the loss without travelling to the last stage (Megatron-LM's
    ``MoEAuxLossAutoScaler``, ``moe_utils.py``)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return h.view_as(h)

    @staticmethod
    def backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dh, torch.ones(ctx.aux_shape, device=dh.device)


class TetradStage(LeanRecvStage):
    """``PipelineStage`` over a model part that drives the part's overlap per phase, holding
    receive buffers only for the micro-batches in flight
    (:class:`tetrad.torch_private.LeanRecvStage`).

    Args:
        part: the stage's :class:`~tetrad.parallel.model.ParallelLlama` part (its ``overlap``
            is driven; a model without one runs as is).
        stage_index, num_stages, device, group: as ``PipelineStage`` (``group``: this rank's
            pipeline line, the ranks with its data, context, Z, Y and X coordinates).
    """

    def __init__(self, part: Transformer, stage_index: int, num_stages: int, device, group):
        forward = StageForward(part, sends=stage_index < num_stages - 1)
        super().__init__(forward, stage_index, num_stages, device, group=group)
        self.overlap = getattr(part, "overlap", None)
        self.grid = getattr(part.layer_factory, "grid", None)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._count(ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._count(ops)
        return ops

    def _count(self, ops: list[dist.P2POp]) -> None:
        """The sends to another rank on the grid's ``pipe`` record (a stage's neighbour on
        the same rank gets its tensors without a send)."""
        if self.grid is not None:
            sends = [op.tensor for op in ops if op.op in (dist.isend, dist.send)]
            count_sends(self.grid, Axis.PIPE, sends)

    def after_shape_inference(self) -> None:
        # The inference's forward and backward leave gradients in the parameters, an MoE
        # part's load-balancing terms and its routers' expert loads: none belongs to a step.
        drop_grads(self.submod.parameters())
        self.submod.aux_total = 0.0
        self.submod.part.take_routing()
        for router in biased_routers(self.submod.part):
            router.tokens_per_expert.zero_()

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs=None, *rest: Any, **kw):
        if self.overlap is None or not torch.is_grad_enabled():
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **kw)
        self.overlap.begin_micro_batch(last=False, phase="forward")
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *rest, **kw)
        finally:
            self.overlap.end_micro_batch()

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss=None, full_backward=True, last_backward=False
    ):
        if self.overlap is None:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        self.overlap.begin_micro_batch(last=last_backward, phase="backward")
        try:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        finally:
            self.overlap.end_micro_batch()
