"""What every part of ``benchmarks/gpu_check.py`` shares: the repository, seed and grid, one
progress line, a part guarded against exceptions, timings, the world-of-one process group and
subprocesses with their output logged."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from tetrad.grid import Grid, backend_for

REPO = Path(__file__).resolve().parents[2]
"""The checkout: the training runs start in it, with it first on ``PYTHONPATH``."""
SEED = 1234
"""The seed of every weight (``init_parameters``) and batch of the checks."""
GRID = (1, 1, 1, 1)
"""``G_data, G_z, G_y, G_x``: one GPU."""
T = TypeVar("T")


def say(msg: str) -> None:
    """One progress line on stdout."""
    print(f"gpu_check: {msg}", flush=True)


def guarded(errors: dict[str, str], part: str, fn: Callable[[], T]) -> T | None:
    """``fn()``, or None after recording its exception under ``errors[part]`` (one failing part
    must not hide the figures of the others)."""
    try:
        return fn()
    except Exception as e:
        errors[part] = "".join(traceback.format_exception(e)[-3:]).strip()
        say(f"{part} failed: {e!r}")
        return None


@contextlib.contextmanager
def timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Record the seconds of the ``with`` body under ``timings[key]``."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[key] = time.monotonic() - t0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def world_of_one(device_type: str) -> Iterator[Grid]:
    """A world-size-1 process group in this process (NCCL on CUDA, gloo on CPU) and the grid
    1,1,1,1 over it; destroyed on exit."""
    if device_type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend_for(device_type),
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
    )
    try:
        yield Grid.build(GRID, device_type)
    finally:
        dist.destroy_process_group()


def subprocess_env() -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` (tetrad need not be
    installed)."""
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def run_logged(cmd: list[str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run ``cmd`` in its own session with stdout and stderr into ``log``: ``(exit status or
    None after the timeout, wall seconds)``. On a timeout or an interrupt the whole session
    (the command and the workers it started) is killed."""
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=subprocess_env(),
            start_new_session=True,
        )
        try:
            rc: int | None = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, time.perf_counter() - t0
