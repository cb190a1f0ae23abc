"""Measured against planned pipeline bubble on CPU ranks (gloo), per schedule.

    PYTHONPATH=. python benchmarks/pipeline.py [--model small,n_layers=8] [--steps 6]

For each case (pipeline ranks ``p``, schedule, virtual stages ``v``; every other axis 1) the
``small`` Llama with 8 blocks trains ``--steps`` steps of 8 micro-batches through
:class:`tetrad.pipeline.schedule.Pipeline`. Each rank times its stages' computation (the
``forward_one_chunk`` and ``backward_one_chunk`` calls of ``torch.distributed.pipelining``,
receives included, sends not waited, and the last stage's LM head and loss) and the
schedule's step (forward and backward of every micro-batch; the gradient reductions and the
optimizer after it are not counted). Per step,
the slowest rank's busy time ``B`` gives one micro-batch's forward plus backward through it,
``t_fb = B / m``; the planner's bubble (:func:`tetrad.plan.pipe.schedule.bubble_seconds`:
``(p-1) t_fb``, ``/ v`` interleaved; Narayanan et al., arXiv 2104.04473, section 2.2) is
compared with the measured one, the schedule's step time minus ``B``. Medians over the steps
after the first (which infers the boundary shapes).

On a 2-core machine 4 ranks share 2 cores, so a waiting rank lends its core to a busy one: the
4-rank rows measure contention as much as the schedule (said in the output).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tetrad.grid import Grid  # noqa: E402
from tetrad.models.config import parse_model  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.pipeline.schedule import Pipeline  # noqa: E402
from tetrad.pipeline.stage import TetradStage  # noqa: E402
from tetrad.pipeline.step import pipeline_train_step  # noqa: E402
from tetrad.plan.pipe.schedule import bubble_seconds  # noqa: E402
from tetrad.train.step import build_optimizer  # noqa: E402

CASES = [(2, "gpipe", 1), (2, "1f1b", 1), (2, "interleaved-1f1b", 2), (4, "1f1b", 1)]
MICRO_BATCHES, MICRO, SEQ = 8, 2, 128


def _timed(method, counter: str = "busy"):
    def run(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            setattr(self, counter, getattr(self, counter) + time.perf_counter() - t0)

    return run


TetradStage.busy = 0.0
TetradStage.forward_one_chunk = _timed(TetradStage.forward_one_chunk)
TetradStage.backward_one_chunk = _timed(TetradStage.backward_one_chunk)
Pipeline.busy = 0.0
Pipeline.step = _timed(Pipeline.step)  # the schedule alone, not the optimizer's part
Pipeline.loss_busy = 0.0
Pipeline._loss = _timed(Pipeline._loss, "loss_busy")  # the LM head and loss, last stage


def _case(model: str, pipe: int, schedule: str, virtual: int, steps: int, out) -> None:
    cfg, _ = parse_model(model)
    grid = Grid.build((1, 1, 1, 1, 1), pipe=pipe)
    pipeline = Pipeline(cfg, grid, schedule, virtual, MICRO_BATCHES)
    for part in pipeline.parts:
        init_parameters(part, 0, grid)
    opt = build_optimizer(pipeline.parts, 1e-4, 0.1)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(steps):
        batch = torch.randint(0, cfg.vocab_size, (MICRO_BATCHES * MICRO, SEQ + 1), generator=gen)
        for stage in [pipeline, *pipeline.stages]:
            stage.busy = 0.0
        pipeline.loss_busy = 0.0
        dist.barrier()
        pipeline_train_step(pipeline, opt, batch, 1.0)
        work = sum(s.busy for s in pipeline.stages) + pipeline.loss_busy
        busy = torch.tensor([work, pipeline.busy])
        every = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(every, busy)
        rows.append(torch.stack(every))
    if dist.get_rank() == 0:
        out.put([r.tolist() for r in rows[1:]])


def _worker(rank: int, world: int, port: int, args, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _case(args[0], *args[1:], out)
    finally:
        dist.destroy_process_group()
    # leave without interpreter teardown: a joinable gloo thread would abort the process
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small,n_layers=8")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    print(f"model {args.model}, {MICRO_BATCHES} micro-batches of {MICRO} x {SEQ} tokens per step")
    print("| p | schedule | v | step | busiest rank | planned bubble | measured bubble | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for pipe, schedule, virtual in CASES:
        out = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        case = (args.model, pipe, schedule, virtual, args.steps)
        mp.start_processes(_worker, (pipe, port, case, out), nprocs=pipe, start_method="spawn")
        rows = [torch.tensor(r) for r in out.get()]
        step = statistics.median(float(r[:, 1].max()) for r in rows)
        busy = statistics.median(float(r[:, 0].max()) for r in rows)
        planned = bubble_seconds(schedule, pipe, virtual, busy / MICRO_BATCHES)
        measured = step - busy
        print(
            f"| {pipe} | {schedule} | {virtual} | {step:.3f} s | {busy:.3f} s | "
            f"{planned:.3f} s | {measured:.3f} s | {measured / planned:.2f} |",
            flush=True,
        )
    if (os.cpu_count() or 1) < 4:
        print(f"({os.cpu_count()} cores: the 4-rank row shares cores between ranks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
