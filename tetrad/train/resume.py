"""What a run starts from: a fresh start, ``--resume``, or an elastic restart.

* A fresh run refuses a run directory that already holds checkpoints (nothing is overwritten).
* ``--resume`` continues from the latest complete checkpoint and is an error when there is
  none (a job script that resumes by default should check for ``RUN_DIR/checkpoints/latest``).
* A restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, set by ``tetrad train --max-restarts``
  and by ``torchrun --max-restarts``) resumes from the latest complete checkpoint by itself, or
  starts over when the failure came before the first one.

``metrics.jsonl`` keeps the rows up to the step resumed from, so the rows of steps lost in a
crash are not duplicated; each later row counts the restarts so far.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tetrad.train.checkpoint_dir import CheckpointError, latest_checkpoint
from tetrad.train.config import ConfigError, TrainConfig
from tetrad.train.metrics import read_rows

LOCAL_WORKER = "TETRAD_LOCAL_WORKER"
"""Set in the environment of the workers ``tetrad train`` starts itself (its launcher ran the
preflight and said what it had to say)."""


def restart_count() -> int:
    """How many times the elastic agent has restarted this job's workers (0: first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def tetrad_version() -> str:
    """The installed tetrad version ("unknown" when run from a source tree)."""
    try:
        return version("tetrad")
    except PackageNotFoundError:
        return "unknown"


def check_run_dir(run_dir: str | Path) -> Path:
    """Create the run directory if needed and check it can be written (``--resume`` of a
    missing one is refused before, by :meth:`TrainConfig.check`).

    Raises:
        ConfigError: the path is a file, or cannot be created or written.
    """
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--run-dir {path} is a file: pass a folder (new or from a run)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create --run-dir {path} ({e.strerror}): pass another") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir {path} is not writable: pass another folder")
    return path


def start_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint this run starts from, or None for step 0 (see the module docstring).

    Raises:
        CheckpointError: ``--resume`` with no checkpoint; a fresh run over existing
            checkpoints; ``latest`` naming a missing or incomplete folder.
    """
    run_dir = Path(cfg.checkpoint.run_dir)
    latest = latest_checkpoint(run_dir)
    if restart_count() or cfg.checkpoint.resume:
        if latest is None and not restart_count():
            raise CheckpointError(
                f"--resume: {run_dir / 'checkpoints'} has no complete checkpoint to resume "
                "from: drop --resume to start a fresh run"
            )
        return latest
    if latest is not None:
        raise CheckpointError(
            f"{run_dir} already holds checkpoints (latest {latest.name}): pass --resume to "
            "continue that run, or another --run-dir to start a new one"
        )
    return None


def trim_metrics(run_dir: Path, start: int) -> None:
    """Keep the ``metrics.jsonl`` rows of steps ``<= start`` (all of them lost otherwise when
    ``start`` is 0): the steps after the checkpoint run again and write their rows anew."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return
    rows, _ = read_rows(path)  # without the lines a crash cut short
    kept = [json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= start]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
