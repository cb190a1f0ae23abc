"""Measured against planned pipeline bubble on CPU ranks (gloo), per schedule; and tetrad's
pipeline grid against the stock analogue.

    PYTHONPATH=. python benchmarks/pipeline.py [--model small,n_layers=8] [--steps 6]
    PYTHONPATH=. python benchmarks/pipeline.py --vs-stock [--repeats 3]

``--vs-stock``: tetrad's grid ``pipe=2`` against the same Llama split by hand into two stock
``PipelineStage``s (``tetrad.models.reference``: ``torch.nn`` layers, the same split, loss
and schedule, AdamW and a global gradient norm over the stages), 1F1B and GPipe, in fresh
processes, interleaved and repeated: median step times and the bytes each sends per step.

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

from torch.distributed.pipelining import PipelineStage  # noqa: E402

from tetrad.grid import Grid  # noqa: E402
from tetrad.models.config import parse_model  # noqa: E402
from tetrad.models.llama import ModelPart  # noqa: E402
from tetrad.models.reference import Llama  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.pipeline.schedule import SCHEDULES, Pipeline  # noqa: E402
from tetrad.pipeline.split import balanced_split  # noqa: E402
from tetrad.pipeline.stage import StageForward, TetradStage  # noqa: E402
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
    _, _, pipeline, opt, batches = _pipeline(model, pipe, schedule, virtual)
    rows = []
    for _ in range(steps):
        batch = next(batches)
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


class _CountingStage(PipelineStage):
    """Stock ``PipelineStage`` that adds up the bytes it sends (for the comparison only)."""

    sent = 0

    def get_fwd_send_ops(self, chunk: int) -> list:
        ops = super().get_fwd_send_ops(chunk)
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    def get_bwd_send_ops(self, chunk: int) -> list:
        ops = super().get_bwd_send_ops(chunk)
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops


def _stock_step(stage, schedule, opt, batch, n_tokens) -> None:
    """What a stock user writes: the schedule, a global gradient norm over the stages
    (torch.nn.utils.clip_grad_norm_ sees only its own), clipping, AdamW."""
    args = (batch[:, :-1],) if stage.is_first else ()
    if stage.is_last:
        schedule.step(*args, target=batch[:, 1:], losses=[], return_outputs=False)
    else:
        schedule.step(*args, return_outputs=False)
    grads = [p.grad for p in stage.submod.parameters() if p.grad is not None]
    sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
    dist.all_reduce(sq)
    torch._foreach_mul_(grads, (1.0 / (sq.sqrt() + 1e-6)).clamp(max=1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)


def _stock_case(model: str, pipe: int, schedule_name: str, steps: int, out) -> None:
    """The same Llama split by hand (``tetrad.models.reference``: torch.nn layers) into one
    ``PipelineStage`` per rank under the same schedule and micro-batches."""
    cfg, _ = parse_model(model)
    rank = dist.get_rank()
    start, stop = balanced_split([1.0] * cfg.n_layers, 1.0, 1.0, pipe)[rank]
    part = Llama(cfg, part=ModelPart(start, stop, rank == 0, rank == pipe - 1))
    init_parameters(part, 0)
    n_tokens = MICRO_BATCHES * MICRO * SEQ

    def loss_fn(hidden, targets):
        return part.layer_factory.loss_sum(part.output, hidden, targets) / n_tokens

    stage = _CountingStage(StageForward(part), rank, pipe, torch.device("cpu"))
    cls = SCHEDULES[schedule_name]
    schedule = cls(stage, MICRO_BATCHES, loss_fn=loss_fn, scale_grads=False)
    opt = build_optimizer(part, 1e-4, 0.1)
    batches = _batches(cfg)
    times, sent = [], []
    for _ in range(steps):
        batch = next(batches)
        stage.sent = 0
        dist.barrier()
        t0 = time.perf_counter()
        _stock_step(stage, schedule, opt, batch, n_tokens)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        sent.append(stage.sent)
    if rank == 0:
        out.put((times[1:], sent[1:]))


def _tetrad_timed_case(model: str, pipe: int, schedule: str, steps: int, out) -> None:
    """tetrad's pipe grid, the same model, schedule and micro-batches: whole steps timed."""
    _, grid, pipeline, opt, batches = _pipeline(model, pipe, schedule, 1)
    times, sent = [], []
    for _ in range(steps):
        batch = next(batches)
        grid.comm.reset()
        dist.barrier()
        t0 = time.perf_counter()
        pipeline_train_step(pipeline, opt, batch, 1.0)
        dist.barrier()
        times.append(time.perf_counter() - t0)
        sent.append(grid.comm.reset()["pipe"].bytes)
    if dist.get_rank() == 0:
        out.put((times[1:], sent[1:]))


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


def vs_stock(model: str, steps: int, repeats: int) -> None:
    """tetrad's 2-stage grid against the stock analogue, 1F1B and GPipe, interleaved."""
    print("| schedule | tetrad step | stock step | tetrad / stock | bytes sent per step, rank 0 |")
    print("|---|---|---|---|---|")
    for schedule in ("1f1b", "gpipe"):
        ours, stock = [], []
        for _ in range(repeats):
            t, sent_t = _spawn(2, (_tetrad_timed_case, model, 2, schedule, steps))
            s, sent_s = _spawn(2, (_stock_case, model, 2, schedule, steps))
            ours.append(statistics.median(t))
            stock.append(statistics.median(s))
        a, b = statistics.median(ours), statistics.median(stock)
        print(
            f"| {schedule} | {a:.3f} s | {b:.3f} s | {a / b:.2f} | tetrad {sent_t[-1]:,.0f} "
            f"(with the 4-byte loss all-reduce), stock {sent_s[-1]:,} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small,n_layers=8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--vs-stock", action="store_true", help="the stock comparison only")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (--vs-stock)")
    args = p.parse_args(argv)
    if args.vs_stock:
        print(f"model {args.model}, {MICRO_BATCHES} micro-batches of {MICRO} x {SEQ} tokens")
        vs_stock(args.model, args.steps, args.repeats)
        return 0
    ctx = mp.get_context("spawn")
    print(f"model {args.model}, {MICRO_BATCHES} micro-batches of {MICRO} x {SEQ} tokens per step")
    print("| p | schedule | v | step | busiest rank | planned bubble | measured bubble | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for pipe, schedule, virtual in CASES:
        out = ctx.SimpleQueue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        case = (_case, args.model, pipe, schedule, virtual, args.steps)
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
