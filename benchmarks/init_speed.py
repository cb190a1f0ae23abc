"""How long a model takes to build and initialise: ``ParallelLlama(cfg, grid)`` then
:func:`tetrad.parallel.init_parameters`, one process per rank (gloo on CPU, NCCL on CUDA).

Each rank runs with :func:`tetrad.device.threads_per_rank` threads (as ``tetrad train``'s
local workers), waits at a barrier, then times ``time.perf_counter()`` around the construction
and around the initialisation (on CUDA up to a ``torch.cuda.synchronize``), and measures the
CPU time the rank spent in both (``resource.getrusage``: user + system, page faults included).
Printed: the maximum over ranks of each (seconds), the global parameter count, the initialised
parameters per second and, on CUDA, the peak of allocated memory above the parameters. With
``--repeats N`` every measurement is taken N times in fresh processes and the median printed.
The script imports tetrad from the checkout it sits in, unless ``PYTHONPATH`` is set (to time
another version of tetrad with this script, set ``PYTHONPATH`` to its checkout).

Run from the repository root::

    python benchmarks/init_speed.py [--model llama-1b] [--grid 1,1,1,1 --grid 1,2,1,2]
        [--device cpu] [--seed 0] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if "PYTHONPATH" not in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tetrad.device import threads_per_rank  # noqa: E402
from tetrad.grid import Grid  # noqa: E402
from tetrad.parallel import init_parameters  # noqa: E402
from tetrad.parallel.model import ParallelLlama  # noqa: E402
from tetrad.spec.grid import parse_grid  # noqa: E402
from tetrad.spec.presets import parse_model  # noqa: E402


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, world: int, sizes: tuple, args: argparse.Namespace, port: int, out: str):
    torch.set_num_threads(threads_per_rank(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    grid = Grid.build(sizes, args.device)
    cfg = parse_model(args.model)[0]
    dist.barrier()
    t0, c0 = time.perf_counter(), _cpu_s()
    net = ParallelLlama(cfg, grid)
    t1 = time.perf_counter()
    init_parameters(net, args.seed, grid)
    if cuda:
        torch.cuda.synchronize()
    t2, c2 = time.perf_counter(), _cpu_s()
    local = sum(p.numel() * p.element_size() for p in net.parameters())
    total = sum(math.prod(p.placement.shape) for p in net.parameters())
    extra = torch.cuda.max_memory_allocated() - local if cuda else 0
    times = torch.tensor(
        [t1 - t0, t2 - t1, c2 - c0, extra], dtype=torch.float64, device=grid.device
    )
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        keys = ("build_s", "init_s", "cpu_s", "extra_bytes")
        res = dict(zip(keys, times.tolist(), strict=True)) | {"params": total}
        Path(out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace, sizes: tuple) -> dict:
    """One fresh set of ``prod(sizes)`` rank processes: ``{"build_s", "init_s", "cpu_s",
    "extra_bytes", "params"}`` (the maximum over ranks of each; ``extra_bytes``: the peak of
    CUDA memory allocated above the rank's parameters, 0 on CPU)."""
    world = math.prod(sizes)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        a = (world, sizes, args, port, str(out))
        mp.start_processes(_worker, args=a, nprocs=world, start_method="spawn")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--grid", action="append", help="DATA,Z,Y,X (repeatable; default 1,1,1,1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    print(f"tetrad from {Path(sys.modules['tetrad'].__file__).parent}, {os.cpu_count()} CPUs")
    for text in args.grid or ["1,1,1,1"]:
        sizes = parse_grid(text)
        runs = [measure(args, sizes) for _ in range(args.repeats)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        n, init = runs[0]["params"], med["init_s"]
        extra = f", {med['extra_bytes'] / 2**20:.0f} MiB above the parameters" * (
            args.device == "cuda"
        )
        print(
            f"{args.model} grid {text} on {args.device} ({math.prod(sizes)} ranks, "
            f"{threads_per_rank(math.prod(sizes))} threads each): {n / 1e9:.3f}e9 parameters, "
            f"build {med['build_s']:.2f} s, init {init:.2f} s ({n / init / 1e9:.3f}e9 "
            f"parameters/s), CPU {med['cpu_s']:.2f} s{extra}; median of {args.repeats}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
