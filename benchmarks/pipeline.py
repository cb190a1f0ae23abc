"""Measured against planned pipeline bubble on CPU ranks (gloo), per schedule.

    PYTHONPATH=. python benchmarks/pipeline.py [--pipe 2,4] [--runs 3] [--steps 6] [--json F]
    PYTHONPATH=. python benchmarks/pipeline.py --from-json F

For each case (``p`` pipeline ranks, one process each, every other axis 1; GPipe, 1F1B and
interleaved 1F1B with ``v = 2``) the ``small`` Llama with 8 blocks (``--model``) trains
``--steps`` steps of ``m = 8`` micro-batches of 2 x 128 tokens through
:class:`tetrad.pipeline.schedule.Pipeline`, in ``--runs`` fresh runs, the cases interleaved.
Each rank records per step (:mod:`pipeline_timing`, beside this file): each of its stages'
forwards (``forward_one_chunk``, which the schedule calls after the chunk's receives; the last
stage's with the LM head and loss) and backwards, in wall and thread-CPU seconds; the schedule's
step in wall seconds; and the step's CPU clock: each rank's thread-CPU seconds since the step
began, raised on every received activation or gradient to the sender's clock (sent with it), so
that the largest end clock is the longest chain of CPU work and receives of the schedule that
ran, the step as it would run with a core per rank, without the transfers' own time.

In each clock, the busiest rank's forwards, loss and backwards ``B = m max_r T_r``; the planned
bubble is the planner's own step for the per-stage times measured,
:func:`tetrad.plan.pipe.critical_path.schedule_step` (what
:func:`tetrad.plan.pipe.pipeline_step.pipeline_estimate` takes: the critical path of the schedule's
order on those stage times), minus ``B``; the measured one the step minus ``B``. ``classic`` is
the even-rank formula ``(p - 1) max_r T_r / v`` (Narayanan et al., arXiv 2104.04473, section
2.2) for comparison: the runtime's split leaves the ranks uneven (the LM head and loss weigh
several blocks on this model), and the bubble is what the other ranks' work leaves idle on the
busiest. Medians over each run's steps after the first (which infers the boundary shapes), then
over the runs; the range is the runs' measured/planned ratios. The last table gives the per-rank
times.

The CPU clock is the measurement for 4 ranks on 2 cores, or a loaded machine: a rank that waits
uses no CPU and one that shares its core counts only its own CPU seconds (which sharing
lengthens by a few per cent through the caches). The wall clock is meaningful only with a free
core per rank.

tetrad's pipeline grids against the stock analogue (the same Llama split by hand into
``PipelineStage``s): ``benchmarks/vs_pytorch.py --modes pp``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # pipeline_timing
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pipeline_timing as timing  # noqa: E402

from tetrad.grid import Grid  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.pipeline.schedule import Pipeline  # noqa: E402
from tetrad.pipeline.step import pipeline_train_step  # noqa: E402
from tetrad.spec.presets import parse_model
from tetrad.train.step import build_optimizer  # noqa: E402

CASES = [(p, s, v) for p in (2, 4) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))]
MICRO_BATCHES, MICRO, SEQ = 8, 2, 128


def _pipeline(model: str, pipe: int, schedule: str, virtual: int):
    """``(cfg, grid, pipeline, optimizer, batches)``: tetrad's ``pipe``-stage grid (every other
    axis 1) on ``model``, initialised, and an endless source of random global batches."""
    cfg, _ = parse_model(model)
    grid = Grid.build((1, 1, 1, 1, 1), pipe=pipe)
    pipeline = Pipeline(cfg, grid, schedule, virtual, MICRO_BATCHES)
    for part in pipeline.parts:
        init_parameters(part, 0, grid)
    opt = build_optimizer(pipeline.parts, 1e-4, 0.1)
    return cfg, grid, pipeline, opt, _batches(cfg)


def _batches(cfg):
    gen = torch.Generator().manual_seed(0)
    while True:
        yield torch.randint(0, cfg.vocab_size, (MICRO_BATCHES * MICRO, SEQ + 1), generator=gen)


def _case(model: str, pipe: int, schedule: str, virtual: int, steps: int, out) -> None:
    """Train ``steps`` steps; rank 0 puts ``[step][rank][field]`` (:data:`timing.FIELDS`)."""
    timing.instrument()
    _, _, pipeline, opt, batches = _pipeline(model, pipe, schedule, virtual)
    rows = []
    for _ in range(steps):
        batch = next(batches)
        timing.reset()
        dist.barrier()
        pipeline_train_step(pipeline, opt, batch, 1.0)
        mine = torch.tensor([timing.TOTALS[k] for k in timing.FIELDS], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        rows.append(torch.stack(every).tolist())
    if dist.get_rank() == 0:
        out.put(rows[1:])


def _worker(rank: int, world: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        args[0](*args[1:], out)
    finally:
        dist.destroy_process_group()
    # leave without interpreter teardown: a joinable gloo thread would abort the process
    sys.stdout.flush()
    os._exit(0)


def _spawn(nprocs: int, case: tuple):
    """Run ``case[0](*case[1:], out)`` on ``nprocs`` fresh ranks; rank 0's result."""
    out = mp.get_context("spawn").SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, (nprocs, port, case, out), nprocs=nprocs, start_method="spawn")
    return out.get()


def _report(runs: dict, pipes: list[int]) -> None:
    """The tables of the module doc."""
    m = MICRO_BATCHES
    cpu = {c: timing.summary(r, c, m, "cpu") for c, r in runs.items()}
    wall = {c: timing.summary(r, c, m, "wall") for c, r in runs.items()}
    n = len(next(iter(runs.values())))
    print(f"\nCPU clock (a core per rank), medians of {n} runs' step medians; ratio range: runs")
    print(
        "| p | schedule | v | step | busiest rank | planned bubble | measured bubble | "
        "measured / planned | classic (p-1)T/v | measured / classic |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (p, schedule, v), s in cpu.items():
        lo, hi = s["ratios"][0], s["ratios"][-1]
        print(
            f"| {p} | {schedule} | {v} | {s['step']:.3f} s | {s['busy']:.3f} s | "
            f"{s['planned']:.3f} s | {s['measured']:.3f} s | "
            f"**{s['measured'] / s['planned']:.2f}** ({lo:.2f}-{hi:.2f}) | "
            f"{s['classic']:.3f} s | {s['measured'] / s['classic']:.2f} |"
        )
    print("\nWall clock (meaningful only with a free core per rank)")
    print(
        "| p | schedule | v | step | busiest rank | planned bubble | measured bubble | "
        "measured / planned |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (p, schedule, v), s in wall.items():
        lo, hi = s["ratios"][0], s["ratios"][-1]
        print(
            f"| {p} | {schedule} | {v} | {s['step']:.3f} s | {s['busy']:.3f} s | "
            f"{s['planned']:.3f} s | {s['measured']:.3f} s | "
            f"{s['measured'] / s['planned']:.2f} ({lo:.2f}-{hi:.2f}) |"
        )
    if (os.cpu_count() or 1) < max(pipes):
        print(f"({os.cpu_count()} cores: the wall clock of {max(pipes)} ranks shares cores)")
    print("\nPer rank and micro-batch, CPU ms: forward (loss included) / backward, each with half")
    print("the rank's share of the schedule's own work (pipeline_timing.stage_seconds)")
    print("| p | schedule | v | " + " | ".join(f"rank {r}" for r in range(max(pipes))) + " |")
    print("|---|---|---|" + "---|" * max(pipes))
    for (p, schedule, v), s in cpu.items():
        cells = [f"{f * 1e3:.1f} / {b * 1e3:.1f}" for f, b in zip(s["fwd"], s["bwd"], strict=True)]
        cells += [""] * (max(pipes) - p)
        print(f"| {p} | {schedule} | {v} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small,n_layers=8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--runs", type=int, default=3, help="fresh runs per case, interleaved")
    p.add_argument("--pipe", default="2,4", help="pipeline ranks to measure")
    p.add_argument("--json", help="write every rank's records of every step here")
    p.add_argument("--from-json", help="print the tables of records written by --json")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        _report({tuple(c["case"]): c["runs"] for c in saved}, [c["case"][0] for c in saved])
        return 0
    pipes = [int(x) for x in args.pipe.split(",")]
    cases = [c for c in CASES if c[0] in pipes]
    print(f"model {args.model}, {MICRO_BATCHES} micro-batches of {MICRO} x {SEQ} tokens per step")
    runs: dict = {c: [] for c in cases}
    load = os.getloadavg()[0]
    for _ in range(args.runs):
        for c in cases:
            runs[c].append(_spawn(c[0], (_case, args.model, *c, args.steps)))
    if args.json:
        rows = [{"case": c, "fields": timing.FIELDS, "runs": r} for c, r in runs.items()]
        Path(args.json).write_text(json.dumps(rows))
    after = os.getloadavg()[0]
    print(f"load average (1 min): {load:.2f} before, {after:.2f} after; {os.cpu_count()} cores")
    _report(runs, sorted({c[0] for c in cases}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
