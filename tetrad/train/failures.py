"""A worker's failure, reported once: its traceback in ``RUN_DIR/logs/rank_R.log``, one line
in torchelastic's error file, and the launcher's choice of the line to print among the ranks'
(:func:`failure_summary`: a mistake tetrad diagnosed before an error of a collective whose peer
died)."""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tetrad.spec.errors import TetradError
from tetrad.train.config import TrainConfig


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
