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

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from tetrad.device import gpu_count, threads_per_rank
from tetrad.spec.errors import TetradError, error_line
from tetrad.spec.grid import GridError, check_world_size
from tetrad.train.config import TrainConfig
from tetrad.train.failures import failure_summary, record_failure
from tetrad.train.resume import LOCAL_WORKER, check_run_dir
from tetrad.train.run_lock import RunDirLock
from tetrad.train.stop import Stopped, exit_code, signal_name

SHUTDOWN_S = 300
"""Seconds the launcher lets its workers finish a step and save after a signal before it
kills them (torchelastic's default is 30)."""
HANDLED = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
"""Signals the launcher forwards to its workers (torchelastic's default set plus SIGUSR1,
which SLURM's ``--signal=USR1@T`` sends; unhandled, it would kill the launcher)."""


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
        _check_as_one_rank(cfg)
        with _run_lock(cfg, os.environ.get("RANK", "0") == "0"):
            _train_as_one_rank(cfg)
        return
    cfg.check()
    p, (d, c, z, y, x) = cfg.parallelism.pipe, cfg.parallelism.grid
    nproc = p * d * c * z * y * x
    if cfg.training.device == "cuda":
        _check_gpus(nproc, f"ranks of grid pipe*data*context*z*y*x = {p}*{d}*{c}*{z}*{y}*{x}")
    with _run_lock(cfg, True):
        trainer.preflight(cfg)
        pipe = f"pipe={p} " if p > 1 else ""
        print(
            f"tetrad: starting {nproc} workers (grid {pipe}data={d} context={c} z={z} y={y} "
            f"x={x}, {cfg.training.device})",
            flush=True,
        )
        run_local(cfg, nproc)


def _check_as_one_rank(cfg: TrainConfig) -> None:
    """The checks of :func:`launch_train` under ``torchrun``, each mistake said once: one that
    is the same on every rank (the grid against the world size, the values) by rank 0, the GPUs
    of a node by its local rank 0; the other ranks exit with status 2 without a word.

    Raises:
        TetradError: on the rank that says it; SystemExit(2) on the others.
    """
    env = os.environ
    try:
        check_world_size(cfg.parallelism.grid, int(env["WORLD_SIZE"]), cfg.parallelism.pipe)
        cfg.check()
        if cfg.training.device == "cuda":
            _check_local_ranks(env)
    except TetradError:
        if env.get("RANK", "0") != "0":
            raise SystemExit(2) from None
        raise
    if cfg.training.device == "cuda":
        try:
            _check_gpus(int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])), "ranks on this node")
        except TetradError:
            if env.get("LOCAL_RANK", "0") != "0":
                raise SystemExit(2) from None
            raise


def _check_local_ranks(env: dict) -> None:
    """Each rank's GPU is ``cuda:LOCAL_RANK`` (:func:`tetrad.device.local_device`) and a node's
    GPUs are checked against ``LOCAL_WORLD_SIZE``: a launcher of several ranks that sets
    ``RANK`` and ``WORLD_SIZE`` but not these would put every rank on ``cuda:0``.

    Raises:
        GridError: ``WORLD_SIZE > 1`` without ``LOCAL_RANK`` or ``LOCAL_WORLD_SIZE``.
    """
    missing = [k for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if not env.get(k, "").isdigit()]
    if int(env["WORLD_SIZE"]) > 1 and missing:
        raise GridError(
            f"{' and '.join(missing)} not set: with --device cuda each of the "
            f"{env['WORLD_SIZE']} ranks needs its GPU (cuda:LOCAL_RANK) and the ranks of its "
            "node (LOCAL_WORLD_SIZE); launch with torchrun (under SLURM, one torchrun per node "
            "as examples/slurm.sbatch does), or set both for each process"
        )


def _run_lock(cfg: TrainConfig, holder: bool) -> contextlib.AbstractContextManager:
    """The run directory's lock (:mod:`tetrad.train.run_lock`) where this process holds it for
    the job: the launcher started by hand, global rank 0 under ``torchrun``.

    Raises (on entry):
        ConfigError: the directory is not a writable folder, or another run holds it.
    """
    if not holder:
        return contextlib.nullcontext()
    check_run_dir(cfg.checkpoint.run_dir)
    return RunDirLock(cfg.checkpoint.run_dir)


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
    except Stopped as e:  # rank 0 printed the line; the checkpoint is complete
        sys.stdout.flush()
        os._exit(exit_code(e.signum))
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
    if gpu_count() == 0:
        raise GridError("--device cuda, but no GPU is visible here: use --device cpu")
    if gpu_count() < ranks:
        raise GridError(
            f"{ranks} {what} need {ranks} GPUs (NCCL runs one rank per GPU), but "
            f"{gpu_count()} are visible: use a grid of at most {gpu_count()} ranks per node, "
            "more nodes, or --device cpu"
        )


def _resolve_auto_grid(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the grid the planner chooses for this job's ranks and tokenizer."""
    from tetrad.train.auto import choose_grid, default_nproc, is_rank0
    from tetrad.train.preflight import load_corpus

    world = int(os.environ["WORLD_SIZE"]) if under_torchrun() else default_nproc(cfg)
    corpus = load_corpus(cfg)
    return choose_grid(cfg, world, corpus.vocab_size, verbose=is_rank0())


def train_worker(cfg: Any) -> None:
    """Worker entrypoint: ``tetrad.train.trainer.train(cfg)``; a failure becomes one line.

    Module-level so that spawned workers can unpickle it; imports the trainer lazily. On an
    error, the full traceback goes to ``RUN_DIR/logs/rank_R.log`` (a temporary folder when the
    run directory cannot be written) and the one line ``<message> (rank R; traceback in
    <log>)`` to torchelastic's error file, which the launcher prints (:func:`failure_summary`);
    the worker then exits with status 1 without printing anything. Stopped by a signal after
    its checkpoint (:mod:`tetrad.train.stop`), it exits with 143 (130 after Ctrl-C); on a
    Ctrl-C before the training loop, at once with 130.
    """
    try:
        from tetrad.train.trainer import train

        train(cfg)
    except Stopped as e:  # checkpoint saved, line printed by rank 0 (tetrad.train.stop)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code(e.signum))
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


def _signal_options() -> dict[str, Any]:
    """:data:`HANDLED` and :data:`SHUTDOWN_S` as :class:`LaunchConfig` options, those this
    torch has (2.13 has both)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(LaunchConfig)}
    wanted = {"signals_to_handle": HANDLED, "shutdown_timeout": SHUTDOWN_S}
    return {k: v for k, v in wanted.items() if k in names}


def _stop_record(job: Any, since: float) -> dict | None:
    """``RUN_DIR/logs/stopped.json`` written by rank 0 after a signal's checkpoint (see
    :mod:`tetrad.train.stop`) at or after ``since`` (a ``time.time()``), or None."""
    if not isinstance(job, TrainConfig):
        return None
    path = Path(job.checkpoint.run_dir) / "logs" / "stopped.json"
    try:
        if path.stat().st_mtime >= since:
            return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    return None


def _say_unsaved(job: Any, since: float, sigval: int) -> None:
    """After a signal: nothing when rank 0 already said where the run stopped, else one line
    saying that no checkpoint was saved for the stop and which one a resume would load."""
    if _stop_record(job, since) is not None or not isinstance(job, TrainConfig):
        return
    from tetrad.train.checkpoint_dir import CheckpointError, latest_checkpoint

    try:
        latest = latest_checkpoint(job.checkpoint.run_dir)
    except CheckpointError:
        latest = None
    where = (
        f"continue from {latest.name} with --resume"
        if latest is not None
        else "no checkpoint yet: start the run again"
    )
    print(f"tetrad: stopped by {signal_name(sigval)} before a checkpoint was saved; {where}")


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
        SystemExit(143 or 130): the workers stopped at a step after a signal (SIGTERM, SIGUSR1;
            130 for Ctrl-C) that reached them and not this process.
        KeyboardInterrupt: Ctrl-C before the workers started.

    A signal to this process once the workers run, Ctrl-C included (torchelastic's
    ``SignalException``), ends it with the same status once the workers are gone, without the
    interpreter's teardown (:func:`_leave_after_signal`).
    """
    old_levels = _quiet_torch_logs()
    added = []
    signalled = None  # the exit status after a signal to this process
    if _device(cfg) == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(nproc))
        added.append("OMP_NUM_THREADS")
    if LOCAL_WORKER not in os.environ:
        os.environ[LOCAL_WORKER] = "1"
        added.append(LOCAL_WORKER)
    if _max_restarts(cfg) and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in os.environ:
        # A store shared by the agent outlives the workers: restarted workers then read the
        # dead workers' addresses and fail to connect (PyTorch issue 135712). Without sharing,
        # each attempt's rank 0 hosts a fresh store. Only with restarts: that store's port is
        # probed free by the agent and bound later by rank 0, and in between any outgoing
        # connection on the host may take it (EADDRINUSE, seen twice in one test-suite run);
        # the shared store is bound by the agent before the workers start.
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
                **_signal_options(),
            )
            started = time.time()
            try:
                elastic_launch(config, entrypoint)(cfg)
            except ChildFailedError as e:
                stopped = _stop_record(cfg, started)
                if stopped and all(f.exitcode in (130, 143) for f in e.failures.values()):
                    raise SystemExit(max(f.exitcode for f in e.failures.values())) from None
                print(error_line(failure_summary(e)), file=sys.stderr)
                raise SystemExit(1) from None
            except SignalException as e:
                _say_unsaved(cfg, started, e.sigval)
                signalled = exit_code(e.sigval)
    finally:
        _restore_logs(old_levels)
        for name in added:
            os.environ.pop(name, None)
    if signalled is not None:
        _leave_after_signal(signalled)


def _leave_after_signal(code: int) -> None:
    """End the launcher with ``code`` without the interpreter's teardown, once its workers are
    gone and its log folder removed. After a signal torchelastic keeps the job's rendezvous
    open (its keep-alive daemon thread goes on calling the c10d store from C++), and an
    interpreter exit that races that thread can abort ("terminate called without an active
    exception": exit -6 instead of 143, seen once in the test suite). The workers leave the
    same way (:func:`train_worker`); the run directory's lock is ``flock``'s, dropped at exit."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
