"""What every module of ``benchmarks/vs_pytorch.py`` shares, at the bottom of its imports: the
run settings (model, batch, steps, optimizer), the pipeline schedules' printed names, and how
the tables print a grid.

The arrows point one way: ``vs_settings`` <- ``stock_parallel`` <- ``vs_jobs`` <- ``vs_report``
<- ``vs_pytorch``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tetrad.spec.grid import GridShape
from tetrad.spec.model import ModelSpec

SCHEDULE_LABELS = {"1f1b": "1F1B", "gpipe": "GPipe"}
"""Pipeline schedules (tetrad's ``--pipeline-schedule`` names) and how the tables print them."""


@dataclass(frozen=True)
class Settings:
    """What every run shares: model, batch, steps, optimizer, and how steps are timed
    (``step_barrier``: a barrier before each step, ``vs_pytorch.measure``)."""

    cfg: ModelSpec
    seq: int = 256
    batch: int = 16
    steps: int = 12
    warmup: int = 3
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    step_barrier: bool = True

    def global_batch(self) -> torch.Tensor:
        """The global batch ``[batch, seq+1]`` of token ids, the same in every run and step."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.cfg.vocab_size, (self.batch, self.seq + 1), generator=gen)


def fmt_grid(sizes: GridShape, orientation: str = "xy") -> str:
    """A grid as the tables print it: ``1,2,1,1``, with `` yx`` when its pairs are turned."""
    return ",".join(map(str, sizes)) + (" yx" if orientation == "yx" else "")
