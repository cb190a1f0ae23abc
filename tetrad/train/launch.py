"""Start the worker processes of a single-machine run with PyTorch's elastic launcher.

``tetrad train`` without ``torchrun`` calls :func:`run_local`, which does what
``torchrun --standalone --nproc_per_node N`` does: a c10d rendezvous on a free local port and
``N`` spawned workers, each with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ... set, each running
``tetrad.train.trainer.train(cfg)``. Worker output goes straight to this terminal (no rank
prefixes); rank 0 prints the progress.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tetrad.device import threads_per_rank


def train_worker(cfg: Any) -> None:
    """Worker entrypoint: ``tetrad.train.trainer.train(cfg)``, printing a traceback on failure.

    Module-level so that spawned workers can unpickle it; imports the trainer lazily. On Ctrl-C
    the worker exits at once with status 130.
    """
    try:
        from tetrad.train.trainer import train

        train(cfg)
    except KeyboardInterrupt:
        # Ctrl-C reaches every worker; leave at once and quietly (a normal interpreter exit
        # with live gloo/NCCL threads aborts with "terminate called without an active exception").
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    except BaseException:
        rank = os.environ.get("RANK", "?")
        print(f"[rank {rank}] worker failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise


def failure_summary(err: ChildFailedError) -> str:
    """One line naming the first failed rank and the first line of its error."""
    rank, failure = err.get_first_failure()
    return f"rank {rank} failed: {_failure_message(failure)}"


def _failure_message(failure: ProcessFailure) -> str:
    msg = failure.message
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    msg = str(msg).strip()
    if failure.error_file_data.get("message") == "<NONE>" or not msg or msg.startswith("To enable"):
        if failure.exitcode < 0:
            return f"killed by signal {failure.signal_name()} (exit code {failure.exitcode})"
        return f"exited with code {failure.exitcode}"
    return msg.splitlines()[0]


def _quiet_torch_logs() -> dict[str, int]:
    """Silence torch's elastic/multiprocessing loggers (the worker prints its own traceback).

    Left alone when the user set ``LOGLEVEL`` (which torch's elastic loggers read). Returns the
    previous levels, for :func:`_restore_logs`.
    """
    if "LOGLEVEL" in os.environ:
        return {}
    old = {}
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(
            ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
        ):
            log = logging.getLogger(name)
            old[name] = log.level
            log.setLevel(logging.CRITICAL)
    return old


def _restore_logs(old: dict[str, int]) -> None:
    for name, level in old.items():
        logging.getLogger(name).setLevel(level)


def run_local(cfg: Any, nproc: int, *, entrypoint: Callable[[Any], Any] = train_worker) -> None:
    """Run ``entrypoint(cfg)`` in ``nproc`` local worker processes (ranks ``0 .. nproc-1``).

    Sets ``OMP_NUM_THREADS`` to :func:`tetrad.device.threads_per_rank` for the workers of a CPU
    run unless the user set it. Blocks until every worker has finished.

    Raises:
        SystemExit(1): a worker failed; one line ``tetrad: error: rank R failed: <error>`` has
            been printed to stderr (the worker's traceback is in the output above it).
        KeyboardInterrupt: Ctrl-C; the workers have been stopped.
    """
    old_levels = _quiet_torch_logs()
    added_omp = False
    if getattr(cfg, "device", "cpu") == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
        added_omp = True
    try:
        with tempfile.TemporaryDirectory(prefix="tetrad_elastic_") as log_dir:
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",  # c10d picks a free port, like torchrun --standalone
                run_id=f"tetrad-{uuid.uuid4().hex[:12]}",
                max_restarts=0,
                start_method="spawn",
                logs_specs=DefaultLogsSpecs(log_dir=log_dir),  # error files only; no redirects
            )
            try:
                elastic_launch(config, entrypoint)(cfg)
            except ChildFailedError as e:
                print(f"tetrad: error: {failure_summary(e)}", file=sys.stderr)
                raise SystemExit(1) from None
            except SignalException as e:
                if e.sigval == signal.SIGINT:
                    raise KeyboardInterrupt from None
                raise SystemExit(128 + int(e.sigval)) from None
    finally:
        _restore_logs(old_levels)
        if added_omp:
            os.environ.pop("OMP_NUM_THREADS", None)
