"""``python -m tetrad.cli ARGS`` for the tests, without paying the interpreter start each time.

Running the ``tetrad`` command in a subprocess costs 2-4 s of interpreter start and imports
(torch) on a 2-core machine, and the suite runs it some 35 times. Instead, one server process
imports tetrad's command line and what it loads once (:data:`PRELOAD`); for each command it
forks a child that points its stdin at ``/dev/null`` and its stdout and stderr at files, takes
the caller's environment and working directory, and runs ``tetrad.cli`` as ``__main__`` (as
``python -m`` does). The child then leaves as a ``python -m tetrad.cli`` process would: its exit
status, a traceback for an uncaught exception, interpreter teardown with the atexit handlers.
What the imports wrote to stderr (a warning, say) is put in front of every command's stderr,
so a test of "exactly one line on stderr" still sees it.

Run as ``python -m tests.cli_fork`` by :func:`run`; requests and replies are JSON lines on the
server's stdin and stdout.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.elastic.multiprocessing",
    "tetrad.calibrate.cli",  # what tetrad.cli imports, not tetrad.cli itself: run_module
    "tetrad.plan.cli",  # runs a fresh copy as __main__ (and warns if it is imported already)
    "tetrad.train.config",
    "tetrad.train.export",
    "tetrad.train.generate",
    "tetrad.train.launch",
    "tetrad.train.trainer",
)


# ---------------------------------------------------------------- the server


def _child(req: dict) -> None:
    """In the forked child: the caller's files, environment and directory; then the command."""
    import runpy

    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    for target, path in ((1, req["stdout"]), (2, req["stderr"])):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = ["tetrad.cli", *req["argv"]]  # run_module puts the module's path first
    runpy.run_module("tetrad.cli", run_name="__main__", alter_sys=True)


def _reply(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def serve() -> None:
    """Import :data:`PRELOAD`, say ``ready``, then run one forked command per request line."""
    for name in PRELOAD:
        __import__(name)
    _reply({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
            sys.exit(0)  # the command returned without sys.exit: status 0, as python -m does
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"returncode": os.waitstatus_to_exitcode(status)})


# ---------------------------------------------------------------- the client


class _Server:
    def __init__(self) -> None:
        self.tmp = tempfile.TemporaryDirectory(prefix="tetrad_cli_fork_")
        err = Path(self.tmp.name) / "server.err"
        with err.open("w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.cli_fork"],
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                env=_base_env(),
            )
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"tests.cli_fork did not start: {err.read_text()[-3000:]}")
        self.import_stderr = err.read_text()  # what importing wrote: every command shows it
        self.count = 0

    def _read(self, timeout: float | None = None) -> dict | None:
        if timeout is not None and not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        return json.loads(self.proc.stdout.readline())

    def run(self, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = (Path(self.tmp.name) / f"{self.count}.{k}" for k in ("out", "err"))
        req = {"argv": argv, "env": env, "cwd": str(ROOT), "stdout": str(out), "stderr": str(err)}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        self.proc.stdin.flush()
        pid = self._read()["pid"]
        done = self._read(timeout)
        if done is None:  # as subprocess.run: kill the command, then raise
            os.kill(pid, signal.SIGKILL)
            self._read()
            raise subprocess.TimeoutExpired(["tetrad", *argv], timeout)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        out.unlink()
        err.unlink()
        return subprocess.CompletedProcess(
            ["tetrad", *argv], done["returncode"], stdout, self.import_stderr + stderr
        )

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.tmp.cleanup()


_server: _Server | None = None


def _base_env() -> dict[str, str]:
    """This process's environment without the launcher's variables (a test may set them)."""
    drop = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    return {k: v for k, v in os.environ.items() if k not in drop}


def run(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m tetrad.cli *args`` (in the checkout, this environment without RANK,
    WORLD_SIZE and TORCHELASTIC_RUN_ID, plus ``env``) as a forked child of the server; stdout
    and stderr as text, like ``subprocess.run(..., capture_output=True, text=True)``."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
        atexit.register(_server.close)
    return _server.run(list(args), {**_base_env(), **(env or {})}, timeout)


if __name__ == "__main__":
    serve()
