"""What ``benchmarks/vs_pytorch.py`` runs: the shared settings, one job per (side, world,
configuration), and the rows that pair each tetrad grid with the stock mode users would pick
instead."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from stock_parallel import SCHEDULE_LABELS, Stock
from vs_report import fmt_grid

from tetrad.models.config import ModelConfig
from tetrad.plan.machine.description import get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import best_orientation
from tetrad.spec import GRID_NAMES, GridShape

ROWS: dict[int, list[tuple[GridShape, Stock]]] = {
    2: [
        ((2, 1, 1, 1), Stock("ddp")),
        ((1, 2, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 1), Stock("tp", 2)),
        ((1, 1, 1, 2), Stock("tp", 2)),
        ((2, 1, 1, 1, 1, 1), Stock("pp", pp=2, schedule="1f1b")),
        ((2, 1, 1, 1, 1, 1), Stock("pp", pp=2, schedule="gpipe")),
    ],
    4: [
        ((4, 1, 1, 1), Stock("ddp")),
        ((1, 4, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 2), Stock("tp", 4)),
        ((1, 1, 1, 4), Stock("tp", 4)),
        ((1, 1, 4, 1), Stock("tp", 4)),
        ((1, 2, 2, 1), Stock("fsdp2-tp", 2)),
        ((2, 1, 2, 1), Stock("fsdp2-tp", 2)),
        ((1, 2, 1, 2), Stock("fsdp2-tp", 2)),
        ((2, 1, 1, 2), Stock("fsdp2-tp", 2)),
        ((1, 1, 2, 2), Stock("fsdp2-tp", 2)),
        ((4, 1, 1, 1, 1, 1), Stock("pp", pp=4, schedule="1f1b")),
        ((2, 2, 1, 1, 1, 1), Stock("pp", pp=2, dp=2, schedule="1f1b")),
    ],
}
"""Per world size: (tetrad grid, the stock mode it is compared with). A grid of six is
``(G_pipe, G_data, G_context, G_z, G_y, G_x)``, run through tetrad's pipeline with the stock
mode's schedule."""

PIPE_MICRO_BATCHES = 8
"""Micro-batches per pipeline step on both sides (fewer where a replica has fewer samples)."""


def micro_batches(s: Settings, replicas: int) -> int:
    """The pipeline's micro-batches per step: :data:`PIPE_MICRO_BATCHES` of the ``s.batch /
    replicas`` samples each pipeline replica gets, or one sample each if fewer."""
    return min(PIPE_MICRO_BATCHES, s.batch // replicas)


@dataclass(frozen=True)
class Settings:
    """What every run shares: model, batch, steps, optimizer."""

    cfg: ModelConfig
    seq: int = 256
    batch: int = 16
    steps: int = 12
    warmup: int = 3
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def global_batch(self) -> torch.Tensor:
        """The global batch ``[batch, seq+1]`` of token ids, the same in every run and step."""
        gen = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.cfg.vocab_size, (self.batch, self.seq + 1), generator=gen)


@dataclass(frozen=True)
class Job:
    """One run: tetrad on ``grid`` or stock PyTorch in ``stock`` mode, on ``world`` ranks."""

    world: int
    settings: Settings
    grid: GridShape | None = None
    stock: Stock | None = None
    orientation: str = "xy"
    schedule: str = ""  # a pipeline grid's schedule (a key of SCHEDULE_LABELS)

    def name(self) -> str:
        """tetrad's grid as the tables print it: ``1,2,1,1`` (`` yx`` when turned), a pipeline
        grid by its axes above 1 and schedule (``pipe=2,data=2 1F1B``)."""
        if len(self.grid) < 6:
            return fmt_grid(self.grid, self.orientation)
        axes = [f"{n}={g}" for n, g in zip(GRID_NAMES, self.grid, strict=True) if g > 1]
        return f"{','.join(axes)} {SCHEDULE_LABELS[self.schedule]}"

    def label(self) -> str:
        return f"tetrad {self.name()}" if self.grid else f"stock {self.stock}"


def auto_orientation(s: Settings, grid: GridShape) -> str:
    """The orientation ``tetrad train`` runs ``grid`` in without ``--machine`` (fewer bytes on
    the X and Y roles: :func:`tetrad.plan.comm.estimate.best_orientation`)."""
    ctx = StepQuestion(s.cfg.spec(), get_machine("dgx-h100"), s.seq, s.batch, compute_bytes=4)
    return best_orientation(ctx, grid, s.batch // (grid[0] * grid[1]), "none")


def tetrad_jobs(world: int, s: Settings, grid: GridShape, how: str, stock: Stock) -> list[Job]:
    """The tetrad runs of one row: ``how`` = ``auto`` (the orientation tetrad train picks),
    ``xy`` (the pairs never turned: the runtime before orientations), or ``both`` (xy, and the
    auto one where it differs: before and after, side by side); a pipeline grid (six sizes,
    X and Y 1: nothing to turn) once, with ``stock``'s schedule."""
    if len(grid) == 6:
        return [Job(world, s, grid=grid, schedule=stock.schedule)]
    turns = {"auto": [auto_orientation(s, grid)], "xy": ["xy"]}.get(how)
    if turns is None:
        turns = list(dict.fromkeys(["xy", auto_orientation(s, grid)]))
    return [Job(world, s, grid=grid, orientation=t) for t in turns]


def schedule(worlds: list[int], modes: set[str], s: Settings, how: str) -> list[Job]:
    """One repeat: for each world, for each row, tetrad then stock (each job once)."""
    jobs: list[Job] = []
    for world in worlds:
        for grid, stock in rows_for(world, modes):
            for job in (*tetrad_jobs(world, s, grid, how, stock), Job(world, s, stock=stock)):
                if job not in jobs:
                    jobs.append(job)
    return jobs


def rows_for(world: int, modes: set[str]) -> list[tuple[GridShape, Stock]]:
    return [(g, m) for g, m in ROWS[world] if m.kind in modes]
