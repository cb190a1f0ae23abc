"""This rank's pipeline: its stage parts, their ``PipelineStage``s and the schedule that runs
them (``torch.distributed.pipelining``: GPipe, 1F1B, interleaved 1F1B).

Losses follow torchtitan's rule for gradient accumulation under a pipeline: the schedule's
``loss_fn`` returns each micro-batch's *sum* of token cross-entropies divided by the global
batch's token count and the schedule does not rescale (``scale_grads=False``), so the summed
gradients are those of the mean loss over the global batch whatever the micro-batch count
(the default ``scale_grads=True`` divides once more by the micro-batch count).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from tetrad.grid import Grid
from tetrad.models.llama import ModelPart
from tetrad.parallel.model import ParallelLlama
from tetrad.pipeline.stage import TetradStage
from tetrad.spec.grid import Axis
from tetrad.spec.model import ModelSpec
from tetrad.spec.pipeline_split import (
    SCHEDULE_NAMES,
    balanced_split,
    check_schedule,
    stages_of_rank,
)

SCHEDULES = dict(
    zip(SCHEDULE_NAMES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B), strict=True)
)
"""``--pipeline-schedule`` names and their ``torch.distributed.pipelining`` classes."""


class RankParts(nn.ModuleList):
    """This rank's model parts, in stage order. Parameter names are the whole model's
    (``layers.5.attention.wqkv.weight``, no ``0.`` prefix), so initialisation, checkpoints and
    Hugging Face names do not depend on the split."""

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        for part in self:
            yield from part.named_parameters(prefix, recurse, remove_duplicate)


class Pipeline:
    """This rank's share of a pipelined model and its schedule.

    Args:
        cfg, grid: the model and the grid (``grid.pipe`` stages).
        schedule: a name of :data:`SCHEDULES`.
        virtual: stages per rank (``v``; 2 or more for ``interleaved-1f1b``).
        micro_batches: ``m``, micro-batches per step (this rank's ``B/(G_data G_z)`` samples
            over the micro-batch size).
        split: ``(start, stop)`` blocks per stage (default: :func:`balanced_split` with every
            block costing 1 and the embedding and the head with its loss 1 each).
        model_kwargs: passed to each :class:`ParallelLlama` part (checkpointing, overlaps).

    Attributes:
        parts: :class:`RankParts`, this rank's parts (the optimizer's and checkpoints' model).
        stages: their :class:`TetradStage`, in stage order.
        n_tokens: the global batch's token count, set before each step (the loss divisor).
        aux_scale: 1 / the global batch's sequences, set before each step of an MoE model
            (the load-balancing terms' divisor; 0: left out).

    Raises:
        PipelineSplitError: see :func:`check_schedule` and :func:`balanced_split`.
    """

    def __init__(
        self,
        cfg: ModelSpec,
        grid: Grid,
        schedule: str,
        virtual: int,
        micro_batches: int,
        split: tuple[tuple[int, int], ...] | None = None,
        **model_kwargs,
    ):
        check_schedule(schedule, grid.pipe, virtual, micro_batches)
        n_stages = grid.pipe * virtual
        self.split = split or balanced_split([1.0] * cfg.n_layers, 1.0, 1.0, n_stages)
        self.grid, self.n_tokens, self.aux_scale = grid, 1, 0.0
        group = grid.mesh.get_group(Axis.PIPE)
        self.parts, self.stages = RankParts(), []
        for s in stages_of_rank(grid.coord[Axis.PIPE], grid.pipe, virtual):
            start, stop = self.split[s]
            part = ModelPart(start, stop, first=s == 0, last=s == n_stages - 1)
            model = ParallelLlama(cfg, grid, part=part, **model_kwargs)
            self.parts.append(model)
            self.stages.append(TetradStage(model, s, n_stages, grid.device, group))
        self.last = self.parts[-1] if self.stages[-1].is_last else None
        cls = SCHEDULES[schedule]
        # one stage per rank on gloo: receives posted ahead (LeanRecvStage.post_ahead)
        if cls is not ScheduleInterleaved1F1B and dist.get_backend(group) == "gloo":
            for stage in self.stages:
                stage.post_ahead = True
        first = self.stages if cls is ScheduleInterleaved1F1B else self.stages[0]
        self.schedule = cls(first, micro_batches, loss_fn=self._loss, scale_grads=False)

    @property
    def is_first(self) -> bool:
        return self.stages[0].is_first

    def aux_loss(self) -> torch.Tensor:
        """This rank's share of the last step's MoE load-balancing term (its stages' blocks,
        its sequences, times :attr:`aux_scale`), a 0-dim fp32 tensor."""
        total = sum((s.submod.aux_total for s in self.stages), 0.0)
        return torch.as_tensor(total, dtype=torch.float32, device=self.grid.device)

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        model = self.last
        vocab = model.cfg.unpadded_vocab or None
        scale = 1 / self.n_tokens  # the schedule's backward brings it (scale_grads=False)
        loss = model.layer_factory.loss_sum(model.output, hidden, targets, vocab, scale)
        return loss / self.n_tokens

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Run the schedule's forward and backward over this rank's samples: ``inputs`` and
        ``targets`` ``[B/(G_data G_z), S/G_context]`` (used on the first and last stage).
        Returns this rank's loss share (the sum over its micro-batches of token-summed
        cross-entropy / :attr:`n_tokens`; 0 off the last stage), a 0-dim tensor. With grad
        disabled, forward only (the schedule's ``eval``)."""
        losses: list[torch.Tensor] = []
        for stage in self.stages:  # MoE load-balancing terms (StageForward)
            stage.submod.aux_scale, stage.submod.aux_total = self.aux_scale, 0.0
        # contiguous: torch 2.11's first stage checks each micro-batch's strides against those
        # of its shape inference, made on contiguous meta copies (inputs are a slice of [b, S+1])
        args = (inputs.contiguous(),) if self.is_first else ()
        run = self.schedule.step if torch.is_grad_enabled() else self.schedule.eval
        if self.last is not None:
            run(*args, target=targets, losses=losses, return_outputs=False)
            return torch.stack([t.detach().float() for t in losses]).sum()
        run(*args, return_outputs=False)
        return torch.zeros((), dtype=torch.float32, device=self.grid.device)  # as the last's
