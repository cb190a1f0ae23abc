"""What the loop of ``tetrad train`` works with on one rank."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from tetrad.data.corpus import Corpus
from tetrad.grid import Grid
from tetrad.parallel.model import ParallelLlama
from tetrad.pipeline.schedule import Pipeline
from tetrad.pipeline.step import pipeline_evaluate, pipeline_train_step_losses
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.config import TrainConfig
from tetrad.train.metrics import StepMeter
from tetrad.train.step import evaluate, train_step_losses
from tetrad.train.stop import StopSignals


class Runner(NamedTuple):
    """This rank's model as the loop uses it, one part or a pipeline's stages alike.

    Attributes:
        parts: the model parts this rank holds (the model, or its pipeline stages' parts).
        weights: the module whose parameters this rank trains and saves (whole-model names).
        train_step: ``(optimizer, batch [B, S+1], grad_clip) -> (loss, aux_loss, grad_norm)``,
            0-dim device tensors (:func:`tetrad.train.step.train_step_losses`).
        evaluate: ``(batches) -> mean cross-entropy`` (nats per token).
    """

    parts: list[ParallelLlama]
    weights: nn.Module
    train_step: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    evaluate: Callable[[list[torch.Tensor]], float]


def runner(model: ParallelLlama | Pipeline, grid: Grid, micro_batch: int) -> Runner:
    """The :class:`Runner` of ``model`` (the one place the loop tells a pipeline from a model).

    Args:
        micro_batch: samples per micro-batch of the plain step (a pipeline's micro-batches
            are its own).
    """
    if isinstance(model, Pipeline):
        return Runner(
            list(model.parts),
            model.parts,
            functools.partial(pipeline_train_step_losses, model),
            functools.partial(pipeline_evaluate, model),
        )

    def step(optimizer, batch, grad_clip):
        return train_step_losses(model, optimizer, grid, batch, micro_batch, grad_clip)

    return Runner(
        [model], model, step, functools.partial(evaluate, model, grid, micro_batch=micro_batch)
    )


@dataclass
class Job:
    """What the loop of :func:`train` works with."""

    cfg: TrainConfig
    grid: Grid
    corpus: Corpus
    model: Runner
    optimizer: torch.optim.Optimizer
    ckpt: Checkpointer
    meter: StepMeter
    rank0: bool
    stop: StopSignals

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.checkpoint.run_dir)
