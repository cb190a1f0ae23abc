"""The sharded optimizer (``shard_optimizer``, ZeRO-1) against tetrad's all-reduce, on CPU.

On ``--world`` gloo ranks (default 4, grid ``DATA=world``), one thread each, the same model
(default ``small``), weights and global batch train with AdamW unsharded and sharded over data;
both models live in the same processes and take turns in ABBA order per repeat, so the machine's
load falls on both alike. Per step: ``time.perf_counter()`` around ``train_step`` with
``float(loss)`` (the maximum over ranks, a barrier before each step); the median over the steps
after ``--warmup`` of every repeat. Also printed: the payload bytes and calls per step on the
data axis (rank 0) and the first-step losses of both (equal to 1e-5 relative or exit 1).

Run from the repository root::

    python benchmarks/sharded_optimizer.py [--world 4] [--model small] [--seq 256]
        [--batch 16] [--steps 8] [--warmup 2] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetrad.grid import Grid  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLlama  # noqa: E402
from tetrad.spec.presets import parse_model
from tetrad.train.step import build_optimizer, train_step  # noqa: E402


def _run(model, opt, grid, batch, micro, steps: int) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        losses.append(float(train_step(model, opt, grid, batch, micro, 1.0)[0]))
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist(), losses


def _worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    grid = Grid.build((args.world, 1, 1, 1))
    cfg = parse_model(args.model)[0]
    gen = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    micro = args.batch // grid.batch_shards
    runs = {}
    for name, shard in (("all-reduce", None), ("sharded", grid)):
        model = ParallelLlama(cfg, grid)
        init_parameters(model, 0, grid)
        runs[name] = (model, build_optimizer(model, 3e-3, 0.1, shard=shard))
    times = {name: [] for name in runs}
    per_repeat = {name: [] for name in runs}
    first, comm = {}, {}
    for r in range(args.repeats):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            model, opt = runs[name]
            t, losses = _run(model, opt, grid, batch, micro, args.steps)
            times[name] += t[args.warmup :]
            per_repeat[name].append(statistics.median(t[args.warmup :]))
            first.setdefault(name, losses[0])
    for name, (model, opt) in runs.items():
        grid.comm.reset()
        train_step(model, opt, grid, batch, micro, 1.0)
        st = grid.comm.reset()["data"]
        comm[name] = {"calls": st.calls, "payload_bytes": st.payload_bytes}
    if rank == 0:
        Path(out).write_text(
            json.dumps({"times": times, "first": first, "comm": comm, "repeats": per_repeat})
        )
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--model", default="small")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.start_processes(_worker, args=(args, port, str(out)), nprocs=args.world)
        res = json.loads(out.read_text())
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(f"data={args.world}, {args.model}, batch {args.batch} x {args.seq}, ", end="")
    print(f"{args.repeats} ABBA repeats x {args.steps - args.warmup} steps (median s/step):")
    for name in res["times"]:
        c = res["comm"][name]
        print(
            f"  {name:10s} {med[name]:.3f} s  data calls {c['calls']}, "
            f"payload {c['payload_bytes'] / 1e6:.2f} MB, first loss {res['first'][name]:.6f}"
        )
    print(f"  sharded / all-reduce: {med['sharded'] / med['all-reduce']:.3f}")
    pairs = zip(res["repeats"]["sharded"], res["repeats"]["all-reduce"], strict=True)
    print("  per repeat: " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in pairs))
    a, b = res["first"].values()
    return 0 if abs(a - b) <= 1e-5 * abs(a) else 1


if __name__ == "__main__":
    sys.exit(main())
