"""tetrad against what users would pick instead: stock PyTorch on the same model and batch.

For each world size (default 2 and 4 processes, CPU, gloo, fp32) this runs, side by side, tetrad's
real training step on several ``G_data,G_z,G_y,G_x`` grids and stock ``torch.distributed`` on the
same Llama (:class:`tetrad.models.reference.Llama`, plain ``torch.nn`` layers), from the same
weights (:func:`tetrad.parallel.init_parameters`, same seed) and the same global batch, and
prints one table per world size: seconds per step, payload bytes per step and first-step losses,
with tetrad/stock ratios, then tetrad's best grid against the best stock mode.

Stock modes, parallelised only with stock APIs:

- ``DDP``: ``DistributedDataParallel``, data parallel over all ranks.
- ``FSDP2``: ``fully_shard`` on each block, then on the root.
- ``TP(n)``: ``parallelize_module`` (1D tensor parallel, Megatron style): ``ColwiseParallel``
  for the q, k, v, gate (w1) and up (w3) projections, ``RowwiseParallel`` for wo and the down
  projection w2; the embedding ``RowwiseParallel`` (vocabulary-sharded); the LM head
  ``ColwiseParallel`` with vocabulary-sharded logits and ``loss_parallel``. tetrad's Llama may
  fuse q, k, v into ``wqkv`` (output features ordered so that contiguous column shards hold
  whole KV-head groups) and gate, up into ``w13`` (``[gate; up]``, its rows put in rank order
  first: ``stock_parallel.by_rank``), so the same plan applies to them.
  ``PrepareModuleInput`` makes each block's attention and feed-forward input one replicated
  DTensor, so separate projections sum their input gradients locally and all-reduce them once
  (without it each would all-reduce its own). The RMSNorm weights become replicated DTensors
  (``distribute_module``), which ``clip_grad_norm_`` needs: it cannot mix DTensor and
  plain-tensor gradients.
- ``TP(n)+SP``: the same with torch's ``SequenceParallel`` on the norms and the residual
  stream ``Shard(1)`` between the blocks (torchtitan's Llama plan), against tetrad's
  ``y=n`` grid with ``sequence_parallel``.
- ``FSDP2xTP(n)``: a 2D mesh ``("dp", "tp")``: TP as above on ``tp``, then ``fully_shard`` on
  ``dp``.
- ``PP(p) 1F1B`` / ``PP(p) GPipe`` (``--modes pp``; against tetrad's pipeline grids, with the
  same schedule): the Llama split by hand into ``ModelPart``s as tetrad's ``Pipeline`` splits
  it by default (:func:`tetrad.spec.pipeline_split.balanced_split`, each block, the embedding and
  the head costing 1), one ``torch.distributed.pipelining.PipelineStage`` per rank (its input
  and output shapes given: no shape inference) on a mesh ``("pp", "dp")``, pipeline outermost
  as in tetrad, under ``Schedule1F1B`` or ``ScheduleGPipe``. ``PP(2)xDDP(2)`` wraps each stage
  in ``DistributedDataParallel`` over ``dp`` (the stage lets it all-reduce on the last
  micro-batch's backward only). Both sides: 8 micro-batches of each pipeline replica's share
  (one sample each if it has fewer), each micro-batch's loss its summed token cross-entropy
  over the replica's token count, ``scale_grads=False``; the gradient norm over all stages
  (stock: the squares of ``torch.nn.utils.get_total_norm`` all-reduced over ``pp``, then
  ``clip_grads_with_norm_``, as torchtitan); the loss all-reduced from the last stage.

Both sides: AdamW (lr 3e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only, torch's fused
kernel, ``fused=True``, as tetrad's trainer and torchtitan's default use it),
gradient clipping at 1.0, the loss is the mean cross-entropy over all tokens of the global batch,
each data rank takes its share of the batch as one micro-batch (tetrad's data ranks are
``G_data G_z``; the pipelines: 8 micro-batches). Every run is its own set of fresh processes,
one thread each (spawned; or with ``--start-method forkserver``, forked from a server that
imported this script once).

Timing: ``time.perf_counter()`` around each step, ``float(loss)`` included (CPU ops are
synchronous), the ranks started together by a barrier; per step the maximum over ranks; the
median over steps ``warmup+1..steps`` of all repeats. Repeats are interleaved: each repeat runs
every row, tetrad then stock, every other repeat in reverse order (ABBA).

Bytes (per step, rank 0, one extra step after the timed ones): the PAYLOAD of each collective
call, the larger of its input and output buffers (the nccl-tests "size" convention: the tensor
of an all-reduce or broadcast, the gathered output of an all-gather, the unreduced input of a
reduce-scatter), summed over calls. It is not wire traffic (a ring all-reduce sends
``2(p-1)/p`` of it per rank, a ring all-gather or reduce-scatter ``(p-1)/p``). tetrad's figures
come from its own record (:class:`tetrad.comm.collectives.CommLog`, ``payload_bytes`` per
axis); stock figures from a ``TorchDispatchMode`` that sees every c10d op (plain ``dist.*``,
DDP's reducer, FSDP2, the pipeline's ``send`` and ``recv_``) and every functional collective
(DTensor redistributions, ``loss_parallel``) after DTensor has lowered itself to plain tensors.
A point-to-point transfer counts once, at the sender (its tensor's bytes; the receive is the
same bytes again), on both sides: tetrad's ``pipe`` record holds its stages' sends (and the
4-byte loss all-reduce over ``pipe``), stock's ``send`` the stage's. Rank 0 is the first
stage: it sends activations only (the gradients it receives are sent by rank 1).

Run from the repository root (several minutes on 2 cores, as many again with ``pp``)::

    python benchmarks/vs_pytorch.py [--model small] [--seq 256] [--batch 16] [--steps 12]
        [--warmup 3] [--repeats 2] [--worlds 2,4] [--modes ddp,fsdp2,tp,tp-sp,fsdp2-tp,pp]
        [--orientation auto|xy|both] [--json FILE] [--start-method spawn|forkserver]

The exit status is 1 if a first-step loss differs from tetrad's by more than 1e-4 relative (the
comparison would not be apples to apples) or a run failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, also when imported

from collective_counter import CollectiveCounter  # noqa: E402
from stock_parallel import (  # noqa: E402
    STOCK_KINDS,
    build_stock,
    build_stock_pipeline,
    stock_optimizer,
    stock_pipeline_step,
    stock_step,
)
from vs_jobs import ROWS, Job, micro_batches, rows_for, schedule, tetrad_jobs  # noqa: E402
from vs_report import (  # noqa: E402
    best_line,
    detail_lines,
    format_table,
    loss_ok,
    summarise,
    table_row,
)
from vs_settings import Settings  # noqa: E402

from tetrad.grid import Grid  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLlama  # noqa: E402
from tetrad.pipeline.schedule import Pipeline  # noqa: E402
from tetrad.pipeline.step import pipeline_train_step  # noqa: E402
from tetrad.spec.presets import parse_model
from tetrad.train.step import build_optimizer, train_step  # noqa: E402

# ---- spawning ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, job: Job, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(job.world),
        LOCAL_RANK=str(rank),
    )
    # DTensor's note that clip_grad_norm_ on a 2D mesh all-reduces twice: stock behaviour.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group("gloo", rank=rank, world_size=job.world)
    try:
        result = run_tetrad(job) if job.grid else run_stock(job)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "torch.distributed.pipelining",
    "tetrad.models.reference",
    "tetrad.parallel.model",
    "tetrad.pipeline.step",
    "tetrad.train.step",
]


def spawn(job: Job, start_method: str = "spawn") -> dict:
    """Run ``job`` on ``job.world`` fresh processes; rank 0's result, or ``{"error": ...}``.

    ``start_method``: ``spawn`` (each process imports torch and this script) or ``forkserver``
    (processes forked from a server that imported this script once: the same fresh processes,
    started in a fraction of the time; what the test suite uses)."""
    if start_method == "forkserver":  # by name: Python 3.11's server cannot preload __main__
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        try:
            mp.start_processes(
                _worker,
                args=(job, _free_port(), str(out)),
                nprocs=job.world,
                start_method=start_method,
            )
        except ProcessException as e:
            return {"error": str(e).strip().splitlines()[-1]}
        return json.loads(out.read_text())


# ---- measuring (inside a worker) ---------------------------------------------------------------


def measure(step: Callable[[], float], steps: int, barrier: bool = True) -> dict:
    """Run ``step`` (returns the loss) ``steps`` times: per-step seconds (maximum over ranks)
    and losses. With ``barrier`` a barrier before each step starts every rank's clock
    together, so a rank's lag in one step is not counted in the next; without, each rank's
    clock starts where its previous step ended, as tetrad's trainer and the independent
    baseline (``benchmarks/vs_independent.py``) time their steps."""
    times, losses = [], []
    for _ in range(steps):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"times": t.tolist(), "losses": losses}


def run_tetrad(job: Job) -> dict:
    """tetrad's training step on ``job.grid``; bytes from the grid's :class:`CommLog`."""
    s = job.settings
    grid, step = tetrad_pipeline(job) if len(job.grid) == 6 else tetrad_grid(job)
    result = measure(step, s.steps, s.step_barrier)
    grid.comm.reset()
    step()
    stats = grid.comm.reset()
    result["bytes"] = {str(a): st.payload_bytes for a, st in stats.items() if st.calls}
    result["calls"] = {str(a): st.calls for a, st in stats.items() if st.calls}
    return result


def tetrad_grid(job: Job) -> tuple[Grid, Callable[[], float]]:
    """The grid and the step (returning the loss) of :func:`train_step` on ``job.grid``."""
    s = job.settings
    grid = Grid.build(job.grid, "cpu", job.orientation)
    model = ParallelLlama(s.cfg, grid, sequence_parallel=job.sequence_parallel)
    init_parameters(model, s.seed, grid)
    opt = build_optimizer(model, s.lr, s.weight_decay)
    batch, micro_batch = s.global_batch(), s.batch // grid.batch_shards

    def step() -> float:
        return float(train_step(model, opt, grid, batch, micro_batch, s.grad_clip)[0])

    return grid, step


def tetrad_pipeline(job: Job) -> tuple[Grid, Callable[[], float]]:
    """The grid and the step of :func:`pipeline_train_step` on the pipeline grid ``job.grid``
    (``G_pipe`` first) under ``job.schedule``, split as tetrad splits by default."""
    s = job.settings
    grid = Grid.build(job.grid[1:], "cpu", pipe=job.grid[0])
    pipeline = Pipeline(s.cfg, grid, job.schedule, 1, micro_batches(s, grid.batch_shards))
    for part in pipeline.parts:
        init_parameters(part, s.seed, grid)
    opt = build_optimizer(pipeline.parts, s.lr, s.weight_decay)
    batch = s.global_batch()

    def step() -> float:
        return float(pipeline_train_step(pipeline, opt, batch, s.grad_clip)[0])

    return grid, step


def run_stock(job: Job) -> dict:
    """Stock PyTorch in ``job.stock`` mode; bytes from a :class:`CollectiveCounter`."""
    s = job.settings
    if job.stock.kind == "pp":
        run = build_stock_pipeline(job.stock, s, micro_batches(s, job.stock.dp))
        stock_fn = stock_pipeline_step
    else:
        run, stock_fn = build_stock(job.stock, s, job.world), stock_step
    opt = stock_optimizer(run.model, s)
    share = s.global_batch().chunk(run.dp_size)[run.dp_rank]
    tokens, targets = share[:, :-1].contiguous(), share[:, 1:].contiguous()

    def step() -> float:
        return stock_fn(run, opt, tokens, targets, s.grad_clip)

    result = measure(step, s.steps, s.step_barrier)
    with CollectiveCounter() as counter:
        step()
    result["bytes"], result["calls"] = dict(counter.bytes), dict(counter.calls)
    return result


# ---- the report ------------------------------------------------------------------------------


def report(
    results: dict[Job, dict], s: Settings, worlds: list[int], modes: set[str], how: str
) -> bool:
    """Print the tables; returns whether every run finished and every first loss matches."""
    all_ok = True
    for world in worlds:
        pairs = rows_for(world, modes)
        rows = [(j, st) for g, st in pairs for j in tetrad_jobs(world, s, g, how, st)]
        done = [results[j] for j, _ in rows]
        ref = next((r for r in done if "error" not in r), {"error": "no tetrad run"})
        table = []
        for job, stock in rows:
            t = results[job]
            p = results[Job(world, s, stock=stock)]
            table.append(table_row(job, stock, t, p, ref))
            all_ok &= loss_ok(t, ref) and loss_ok(p, ref)
        print(f"\nworld size {world}")
        print(format_table(table))
        print("per repeat s/step; payload bytes per step (rank 0):")
        print("\n".join(detail_lines(results, world)))
        print(best_line(results, world))
    return all_ok


# ---- main --------------------------------------------------------------------------------------

DEFAULT_MODES = tuple(k for k in STOCK_KINDS if k != "pp")
"""The pipeline rows are left out by default: they double the run (``--modes pp`` adds them)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="preset[,key=value...] (default small)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes (2, 4)")
    p.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"stock modes to compare with, of {','.join(STOCK_KINDS)} (default: all but pp)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--orientation",
        choices=("auto", "xy", "both"),
        default="auto",
        help="tetrad's layer pairs: as tetrad train turns them (auto), never turned (xy), or "
        "both side by side where they differ",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--start-method",
        choices=("spawn", "forkserver"),
        default="spawn",
        help="how each run's processes start (forkserver: faster, for smoke runs)",
    )
    a = p.parse_args(argv)
    a.worlds = [int(w) for w in a.worlds.split(",")]
    a.modes = set(a.modes.split(","))
    if bad := [w for w in a.worlds if w not in ROWS]:
        p.error(f"--worlds: no rows for {bad}; choose from {sorted(ROWS)}")
    if bad := a.modes - set(STOCK_KINDS):
        p.error(f"--modes: unknown {sorted(bad)}; choose from {', '.join(STOCK_KINDS)}")
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    return a


def run_all(jobs: list[Job], repeats: int, start_method: str = "spawn") -> dict[Job, dict]:
    """Every job ``repeats`` times, interleaved, every other repeat in reverse order (ABBA: a
    drift of the machine's speed favours neither side); the pooled summary of each."""
    runs: dict[Job, list[dict]] = {j: [] for j in jobs}
    for rep in range(repeats):
        for job in jobs if rep % 2 == 0 else jobs[::-1]:
            r = spawn(job, start_method)
            runs[job].append(r)
            took = r.get("error") or f"{statistics.median(r['times'][job.settings.warmup :]):.3f} s"
            print(f"[{rep + 1}/{repeats}] world {job.world} {job.label()}: {took}", file=sys.stderr)
    return {j: summarise(rs, j.settings.warmup) for j, rs in runs.items()}


def to_json(results: dict[Job, dict], s: Settings, args: argparse.Namespace) -> dict:
    runs = [
        {"world": j.world, "side": "tetrad" if j.grid else "stock", "config": j.label(), **r}
        for j, r in results.items()
    ]
    return {
        "settings": {**asdict(s), "repeats": args.repeats, "worlds": args.worlds},
        "runs": runs,
        "best": {w: best_line(results, w) for w in args.worlds},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg, _ = parse_model(args.model)
    s = Settings(cfg, args.seq, args.batch, args.steps, args.warmup, args.seed)
    print(
        f"model {args.model}: {cfg}; seq {s.seq}, global batch {s.batch}, {s.steps} steps "
        f"(medians over steps {s.warmup + 1}-{s.steps}), {args.repeats} repeats; CPU gloo fp32"
    )
    jobs = schedule(args.worlds, args.modes, s, args.orientation)
    results = run_all(jobs, args.repeats, args.start_method)
    ok = report(results, s, args.worlds, args.modes, args.orientation)
    if args.json:
        args.json.write_text(json.dumps(to_json(results, s, args), indent=1))
    if not ok:
        print("\nFAILED: a run failed or a first-step loss differs from tetrad's", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
