"""Run a function on N gloo ranks (CPU), one process each, for tests and benchmarks.

The ranks are forked from a fork server (``multiprocessing``'s ``forkserver`` start method)
that has imported torch and tetrad once: each rank is still a fresh process, unchanged by
whatever the caller did, but starts in milliseconds instead of importing torch again (a
``spawn`` of 8 ranks took 13 s on a 2-core machine). A forked rank inherits the fork server's
environment, not the caller's, so the caller's ``os.environ`` (say, a ``TETRAD_CACHE`` a test
set) travels with the arguments; the working directory and ``sys.path`` travel as with spawn.
"""

from __future__ import annotations

import fcntl
import functools
import multiprocessing
import os
import random
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

START_METHOD = "forkserver"
# Imported once by the fork server (what a rank would otherwise import itself). No module here
# may start a thread at import: the server forks every rank.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch._inductor.compile_fx",
    "pytest",
    "tetrad.models.reference",
    "tetrad.parallel.model",
    "tetrad.train.step",
    "tetrad.train.trainer",
    "tests.distributed",
    "tests.run_dirs",
]
multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)


def _free_port() -> int:
    """A free TCP port below the kernel's ephemeral range, for rank 0's store.

    A port the kernel chose (bind to port 0) is in the ephemeral range, from which it also
    picks the local port of every outgoing connection: between this probe and rank 0's bind,
    another test's gloo connection could take it (seen as ``EADDRINUSE`` in a full suite run).
    Below that range only an explicit bind can, and the probe finds those."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # the Linux default's start
    rng = random.Random()  # seeded from the OS: not the caller's (tests seed ``random``)
    for _ in range(100):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port found in 10000-{low - 1}")


def _one_compile_at_a_time(lock_path: str) -> None:
    """Make this rank's Inductor compilations take turns with the other ranks' (an exclusive
    ``flock`` on ``lock_path`` around each), so that a graph the ranks compile alike is
    compiled once and read from the FX graph and AOTAutograd caches by the others, instead of
    compiled by all of them at the same moment (each missing the cache: on the tiny model's
    4-rank compiled test, 56 Inductor compilations became 14). The backward graph is compiled
    with its forward graph, under the same turn (not at the first backward), so that the
    AOTAutograd cache entry, written after both, is there for the next rank.

    The lock is held only while compiling, never across a collective, so the ranks cannot
    deadlock on it. Compiled code and results are those of separate compilations (a cache hit
    returns what a miss would have compiled)."""
    import torch._functorch.config
    import torch._inductor.compile_fx as cfx

    original, held = cfx.compile_fx, [False]

    def locked(compile_fn):
        @functools.wraps(compile_fn)
        def call(*args, **kwargs):
            if held[0]:  # a compilation inside one that holds the lock
                return compile_fn(*args, **kwargs)
            with open(lock_path, "a") as fh:
                fcntl.flock(fh, fcntl.LOCK_EX)  # released when fh closes
                held[0] = True
                try:
                    return compile_fn(*args, **kwargs)
                finally:
                    held[0] = False

        return call

    def compile_fx(model, example_inputs, inner_compile=cfx.compile_fx_inner, **kwargs):
        # inner_compile compiles the forward and the backward graph (the latter inside the
        # forward's turn here, or in a turn of its own where AOTAutograd still defers it)
        return locked(original)(
            model, example_inputs, inner_compile=locked(inner_compile), **kwargs
        )

    cfx.compile_fx = compile_fx
    torch._functorch.config.force_non_lazy_backward_lowering = True


def _worker(rank: int, world_size: int, port: int, env: dict, lock: str, fn, args) -> None:
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(1)
    _one_compile_at_a_time(lock)
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

    ``fn`` must be a module-level function (it is pickled into the new processes), and the
    ranks see the caller's environment variables as they are at this call. The ranks compile
    (``torch.compile``) one at a time (:func:`_one_compile_at_a_time`).
    """
    with tempfile.NamedTemporaryFile(prefix="tetrad_compile_", suffix=".lock") as lock:
        mp.start_processes(
            _worker,
            args=(world_size, _free_port(), dict(os.environ), lock.name, fn, args),
            nprocs=world_size,
            start_method=START_METHOD,
        )
