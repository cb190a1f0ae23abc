"""How ``tetrad train`` starts: the launch policy, and the local workers.

:func:`launch_train` decides. Under ``torchrun`` (or SLURM, or any launcher that sets ``RANK``
and ``WORLD_SIZE`` or ``TORCHELASTIC_RUN_ID``) this process is one rank: it checks the grid
against ``WORLD_SIZE`` and trains. Started by hand, it checks everything that can fail before any
worker starts (values, GPUs, data, tokenizer, model vs grid; the corpus is tokenised and cached
here, so the workers only load it) and starts ``G_data*G_z*G_y*G_x`` local workers with
:func:`run_local`, which does what ``torchrun --standalone --nproc_per_node N`` does: a c10d
rendezvous on a free local port and ``N`` spawned workers, each with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` ... set. Worker output goes straight to this terminal (no rank prefixes); rank 0
prints the progress. ``--grid auto`` is resolved by the planner first
(:func:`tetrad.train.auto.choose_grid`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tetrad.device import gpu_count, threads_per_rank
from tetrad.spec import GridError, TetradError, check_world_size, error_line
from tetrad.train.config import TrainConfig


def under_torchrun() -> bool:
    """True when this process is one worker of a ``torchrun`` (or similar) job."""
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)


def launch_train(cfg: TrainConfig) -> None:
    """Run ``tetrad train`` for ``cfg`` (see the module docstring).

    Raises:
        TetradError: a mistake in the configuration, the data or the grid (one line).
        SystemExit(1): a local worker failed (see :func:`run_local`).
    """
    if cfg.parallelism.grid == "auto":
        cfg = _resolve_auto_grid(cfg)
    from tetrad.train import trainer

    if under_torchrun():
        check_world_size(cfg.parallelism.grid, int(os.environ["WORLD_SIZE"]))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        if cfg.training.device == "cuda":
            _check_gpus(local, "ranks on this node")
        cfg.check()
        _train_as_one_rank(cfg)
        return
    cfg.check()
    d, c, z, y, x = cfg.parallelism.grid
    nproc = d * c * z * y * x
    if cfg.training.device == "cuda":
        _check_gpus(nproc, f"ranks of grid data*context*z*y*x = {d}*{c}*{z}*{y}*{x}")
    trainer.preflight(cfg)
    print(
        f"tetrad: starting {nproc} workers (grid data={d} context={c} z={z} y={y} x={x}, "
        f"{cfg.training.device})",
        flush=True,
    )
    run_local(cfg, nproc)


def _train_as_one_rank(cfg: TrainConfig) -> None:
    """Train as one rank of a ``torchrun`` job, each failure reported once: a mistake in the
    input (raised alike on every rank) by rank 0 only, any other error as one line on the rank
    that raised it, its traceback in ``RUN_DIR/logs`` (torchrun's own summary follows).

    Raises:
        TetradError: on rank 0 (the CLI prints it); SystemExit(2) on the other ranks.
    """
    from tetrad.train import trainer

    try:
        trainer.train(cfg)
    except TetradError:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(2) from None
        raise
    except Exception as e:
        print(error_line(record_failure(cfg, e)), file=sys.stderr, flush=True)
        os._exit(1)  # no interpreter teardown: gloo/NCCL threads may still be blocked


def _check_gpus(ranks: int, what: str) -> None:
    """NCCL drives one GPU per rank and refuses two ranks on one device.

    Raises:
        GridError: fewer visible GPUs than ``ranks``.
    """
    if gpu_count() < ranks:
        raise GridError(
            f"{ranks} {what} need {ranks} GPUs (NCCL runs one rank per GPU), but "
            f"{gpu_count()} are visible: use a grid of at most {gpu_count()} ranks per node, "
            "more nodes, or --device cpu"
        )


def _resolve_auto_grid(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the grid the planner chooses for this job's ranks and tokenizer."""
    from tetrad.train.auto import choose_grid, default_nproc, is_rank0
    from tetrad.train.data import prepare_corpus

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else default_nproc(cfg)
    d = cfg.data
    corpus = prepare_corpus(d.paths, d.tokenizer, d.vocab_size, d.val_fraction)
    return choose_grid(cfg, world, corpus.vocab_size, verbose=is_rank0())


def train_worker(cfg: Any) -> None:
    """Worker entrypoint: ``tetrad.train.trainer.train(cfg)``; a failure becomes one line.

    Module-level so that spawned workers can unpickle it; imports the trainer lazily. On an
    error, the full traceback goes to ``RUN_DIR/logs/rank_R.log`` (a temporary folder when the
    run directory cannot be written) and the one line ``<message> (rank R; traceback in
    <log>)`` to torchelastic's error file, which the launcher prints (:func:`failure_summary`);
    the worker then exits with status 1 without printing anything. On Ctrl-C the worker exits
    at once with status 130.
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
    except Exception as e:
        record_failure(cfg, e)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # no interpreter teardown: gloo/NCCL threads may still be blocked


def record_failure(cfg: Any, e: BaseException) -> str:
    """Report the exception ``e`` being handled in this worker: its traceback appended to
    ``RUN_DIR/logs/rank_R.log``, and its one line written to torchelastic's error file
    (``TORCHELASTIC_ERROR_FILE``, where set). Returns the line."""
    rank = os.environ.get("RANK", "?")
    log = _write_traceback(cfg, rank)
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    message = first if isinstance(e, TetradError) else f"{type(e).__name__}: {first}"
    line = f"{message} (rank {rank}; traceback in {log})"
    _record_failure(line, _priority(e))
    return line


def _write_traceback(cfg: Any, rank: str) -> Path:
    """Append this worker's traceback to ``RUN_DIR/logs/rank_R.log``; returns the log's path."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    text = f"--- {stamp}, rank {rank}, restart {restart}\n{traceback.format_exc()}"
    run_dir = cfg.checkpoint.run_dir if isinstance(cfg, TrainConfig) else ""
    folders = [Path(run_dir) / "logs"] if run_dir else []
    for folder in [*folders, Path(tempfile.gettempdir()) / "tetrad-logs"]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"rank_{rank}.log"
            with path.open("a") as f:
                f.write(text)
            return path
        except OSError:
            continue
    return Path("(nowhere: no writable folder)")


# A worker's error, by how likely it is the cause: a mistake tetrad diagnosed, any other
# error, then a collective failing because another rank died.
_CAUSE, _OTHER, _PEER = 0, 1, 2


def _priority(e: BaseException) -> int:
    text = str(e)
    if isinstance(e, TetradError):
        return _CAUSE
    peer = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "timed out")
    return _PEER if any(p in text for p in peer) else _OTHER


def _record_failure(line: str, priority: int) -> None:
    """Write torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, JSON) for this worker,
    with ``line`` as the message; the launcher reads it back as ``ProcessFailure.message``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": "", "timestamp": str(int(time.time())), "tetrad_priority": priority}
    with open(path, "w") as f:
        json.dump({"message": {"message": line, "extraInfo": info}}, f)


def failure_summary(err: ChildFailedError) -> str:
    """One line: the most telling failure of ``err`` (an error tetrad diagnosed before one of
    a collective whose peer died; then the earliest; then the lowest rank) and its rank."""

    def key(item: tuple[int, ProcessFailure]) -> tuple:
        rank, failure = item
        info = failure.error_file_data.get("message", {})
        extra = info.get("extraInfo", {}) if isinstance(info, dict) else {}
        return (extra.get("tetrad_priority", _OTHER), failure.timestamp, rank)

    rank, failure = min(err.failures.items(), key=key)
    message = _failure_message(failure)
    return message if "(rank " in message else f"rank {rank} failed: {message}"


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


def _max_restarts(job: Any) -> int:
    """``--max-restarts`` of a :class:`TrainConfig` (0 for other jobs)."""
    return job.checkpoint.max_restarts if isinstance(job, TrainConfig) else 0


def _device(job: Any) -> str:
    """The device of a job: a :class:`TrainConfig`'s, or a ``device`` attribute's."""
    if isinstance(job, TrainConfig):
        return job.training.device
    return getattr(job, "device", "cpu")


def run_local(cfg: Any, nproc: int, *, entrypoint: Callable[[Any], Any] = train_worker) -> None:
    """Run ``entrypoint(cfg)`` in ``nproc`` local worker processes (ranks ``0 .. nproc-1``).

    Sets ``OMP_NUM_THREADS`` to :func:`tetrad.device.threads_per_rank` for the workers of a CPU
    run unless the user set it. A :class:`TrainConfig` with ``max_restarts`` N > 0 has its
    workers restarted (all of them) up to N times after a failure; they resume from the latest
    checkpoint (:mod:`tetrad.train.resume`). Blocks until every worker has finished.

    Raises:
        SystemExit(1): a worker failed (beyond the restarts); one line
            ``tetrad: error: <error> (rank R; traceback in <log>)`` has been printed to stderr
            (:func:`failure_summary`).
        KeyboardInterrupt: Ctrl-C; the workers have been stopped.
    """
    old_levels = _quiet_torch_logs()
    added = []
    if _device(cfg) == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
        added.append("OMP_NUM_THREADS")
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # A store shared by the agent outlives the workers: restarted workers then read the
        # dead workers' addresses and fail to connect (PyTorch issue 135712). Without sharing,
        # each attempt's rank 0 hosts a fresh store.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        added.append("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    try:
        with tempfile.TemporaryDirectory(prefix="tetrad_elastic_") as log_dir:
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=nproc,
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",  # c10d picks a free port, like torchrun --standalone
                run_id=f"tetrad-{uuid.uuid4().hex[:12]}",
                max_restarts=_max_restarts(cfg),
                start_method="spawn",
                logs_specs=DefaultLogsSpecs(log_dir=log_dir),  # error files only; no redirects
            )
            try:
                elastic_launch(config, entrypoint)(cfg)
            except ChildFailedError as e:
                print(error_line(failure_summary(e)), file=sys.stderr)
                raise SystemExit(1) from None
            except SignalException as e:
                if e.sigval == signal.SIGINT:
                    raise KeyboardInterrupt from None
                raise SystemExit(128 + int(e.sigval)) from None
    finally:
        _restore_logs(old_levels)
        for name in added:
            os.environ.pop(name, None)
