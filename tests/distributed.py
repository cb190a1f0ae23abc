"""Run a function on N gloo ranks (CPU), one process each, for tests and benchmarks."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave without interpreter teardown: a gloo thread still joinable at exit aborts the
    # process ("terminate called without an active exception"), failing a passed test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args) -> None:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; a failure on any rank fails the caller.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    mp.start_processes(
        _worker, args=(world_size, _free_port(), fn, args), nprocs=world_size, start_method="spawn"
    )
