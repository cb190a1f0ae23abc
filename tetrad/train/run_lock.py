"""One run per run directory: an advisory lock on ``RUN_DIR/.lock`` held for the whole run.

``tetrad train`` takes it before anything else touches the directory (the launcher started by
hand; rank 0 under ``torchrun``), so two runs started on one ``--run-dir`` seconds apart cannot
both pass the "already holds checkpoints" check and then share ``metrics.jsonl``. The lock is
``flock``'s: the operating system drops it when the holder exits, however it exits, so a
crashed run leaves nothing to clean up. The file names the holder (host, pid, start time) for
the message a second run prints. On network filesystems ``flock`` works where the mount
supports locks (NFSv4, Lustre mounted with ``flock``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from tetrad.train.config import ConfigError

LOCK_NAME = ".lock"


class RunDirLock:
    """The lock of one run directory; use as a context manager.

    Raises (on entry):
        ConfigError: another process holds it, naming that process's host and pid.
    """

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> RunDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"--run-dir {self.path.parent} is in use by another tetrad train ({holder}): "
                "wait for it to finish, stop it, or pass another --run-dir"
            ) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def _holder(fd: int) -> str:
    """``host H, pid P, started at T`` from the lock file (what it can read of it)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["since"]))
        return f"host {info['host']}, pid {info['pid']}, started {since}"
    except (ValueError, KeyError, OSError):
        return "holder unknown"
