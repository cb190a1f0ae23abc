"""What ``benchmarks/vs_pytorch.py`` runs: one job per (side, world, configuration) over the
shared settings (:mod:`vs_settings`), and the rows that pair each tetrad grid with the stock
mode users would pick instead."""

from __future__ import annotations

from dataclasses import dataclass

from stock_parallel import Stock
from vs_settings import SCHEDULE_LABELS, Settings, fmt_grid

from tetrad.plan.machine.description import get_machine
from tetrad.plan.question import StepQuestion
from tetrad.plan.step_time import best_orientation
from tetrad.spec.grid import GRID_NAMES, GridShape

ROWS: dict[int, list[tuple[GridShape, Stock]]] = {
    2: [
        ((2, 1, 1, 1), Stock("ddp")),
        ((1, 2, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 1), Stock("tp", 2)),
        ((1, 1, 1, 2), Stock("tp", 2)),
        ((1, 1, 2, 1), Stock("tp-sp", 2)),
        ((2, 1, 1, 1, 1, 1), Stock("pp", pp=2, schedule="1f1b")),
        ((2, 1, 1, 1, 1, 1), Stock("pp", pp=2, schedule="gpipe")),
    ],
    4: [
        ((4, 1, 1, 1), Stock("ddp")),
        ((1, 4, 1, 1), Stock("fsdp2")),
        ((1, 1, 2, 2), Stock("tp", 4)),
        ((1, 1, 1, 4), Stock("tp", 4)),
        ((1, 1, 4, 1), Stock("tp", 4)),
        ((1, 1, 4, 1), Stock("tp-sp", 4)),
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
mode's schedule. Against ``TP(n)+SP`` tetrad runs with ``sequence_parallel``."""

PIPE_MICRO_BATCHES = 8
"""Micro-batches per pipeline step on both sides (fewer where a replica has fewer samples)."""


def micro_batches(s: Settings, replicas: int) -> int:
    """The pipeline's micro-batches per step: :data:`PIPE_MICRO_BATCHES` of the ``s.batch /
    replicas`` samples each pipeline replica gets, or one sample each if fewer."""
    return min(PIPE_MICRO_BATCHES, s.batch // replicas)


@dataclass(frozen=True)
class Job:
    """One run: tetrad on ``grid`` or stock PyTorch in ``stock`` mode, on ``world`` ranks."""

    world: int
    settings: Settings
    grid: GridShape | None = None
    stock: Stock | None = None
    orientation: str = "xy"
    schedule: str = ""  # a pipeline grid's schedule (a key of SCHEDULE_LABELS)
    sequence_parallel: bool = False

    def name(self) -> str:
        """tetrad's grid as the tables print it: ``1,2,1,1`` (`` yx`` when turned), a pipeline
        grid by its axes above 1 and schedule (``pipe=2,data=2 1F1B``)."""
        if len(self.grid) < 6:
            return fmt_grid(self.grid, self.orientation) + (" sp" if self.sequence_parallel else "")
        axes = [f"{n}={g}" for n, g in zip(GRID_NAMES, self.grid, strict=True) if g > 1]
        return f"{','.join(axes)} {SCHEDULE_LABELS[self.schedule]}"

    def label(self) -> str:
        return f"tetrad {self.name()}" if self.grid else f"stock {self.stock}"


def auto_orientation(s: Settings, grid: GridShape) -> str:
    """The orientation ``tetrad train`` runs ``grid`` in without ``--machine`` (fewer bytes on
    the X and Y roles: :func:`tetrad.plan.step_time.best_orientation`)."""
    ctx = StepQuestion(s.cfg, get_machine("dgx-h100"), s.seq, s.batch, compute_bytes=4)
    return best_orientation(ctx, grid, s.batch // (grid[0] * grid[1]), "none")


def tetrad_jobs(world: int, s: Settings, grid: GridShape, how: str, stock: Stock) -> list[Job]:
    """The tetrad runs of one row: ``how`` = ``auto`` (the orientation tetrad train picks),
    ``xy`` (the pairs never turned: the runtime before orientations), or ``both`` (xy, and the
    auto one where it differs: before and after, side by side); a pipeline grid (six sizes,
    X and Y 1: nothing to turn) once, with ``stock``'s schedule."""
    if len(grid) == 6:
        return [Job(world, s, grid=grid, schedule=stock.schedule)]
    if stock.kind == "tp-sp":  # one tensor axis, in the Y role
        return [Job(world, s, grid=grid, sequence_parallel=True)]
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
