"""What the loop of ``tetrad train`` works with on one rank."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tetrad.data.corpus import Corpus
from tetrad.grid import Grid
from tetrad.parallel.model import ParallelLlama
from tetrad.pipeline.schedule import Pipeline
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.config import TrainConfig
from tetrad.train.metrics import StepMeter
from tetrad.train.stop import StopSignals


@dataclass
class Job:
    """What the loop of :func:`train` works with."""

    cfg: TrainConfig
    grid: Grid
    corpus: Corpus
    model: ParallelLlama | Pipeline
    optimizer: torch.optim.Optimizer
    ckpt: Checkpointer
    meter: StepMeter
    rank0: bool
    stop: StopSignals

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.checkpoint.run_dir)
