"""Stopping a run at a step boundary on a signal, with a checkpoint (preemption).

SLURM sends SIGTERM (or, with ``--signal=USR1@120``, SIGUSR1 ahead of time) before its SIGKILL,
and Ctrl-C sends SIGINT: each rank's :class:`StopSignals` only notes the signal; after every
step the ranks agree (an all-reduce of the signal number over a gloo group of their own, on the
host: no device synchronisation), so they all stop after the same step even when the signal
reaches them at different times. The trainer then saves a checkpoint synchronously and raises
:class:`Stopped`; the worker exits with :func:`exit_code`. A second Ctrl-C (SIGINT more than
:data:`REPEAT_S` after the first) exits at once; a SIGINT within that window is the same key
press, forwarded to the workers again by the launcher.

Megatron-LM does the same with ``--exit-signal-handler`` (a flag all-reduced after each step).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_S = 2.0  # a SIGINT within this many seconds of the first is the same Ctrl-C


class Stopped(Exception):
    """Raised by the trainer after it saved the checkpoint of step ``step`` because of
    ``signum``."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        super().__init__(stop_line(signum, step, checkpoint))
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGUSR1``, ``SIGINT``, ..."""
    return signal.Signals(signum).name


def stop_line(signum: int, step: int, checkpoint: str) -> str:
    """The one line that says what happened and how to go on."""
    return (
        f"tetrad: stopped by {signal_name(signum)} at step {step}; checkpoint {checkpoint} saved; "
        "continue with --resume"
    )


def exit_code(signum: int) -> int:
    """130 after SIGINT, 143 (what SIGTERM's default action gives) after SIGTERM or SIGUSR1."""
    return 128 + (signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)


class StopSignals:
    """Notes SIGTERM, SIGUSR1 and SIGINT in this process and lets the ranks agree on them.

    Create it as early as possible on every rank (a signal during start-up is then acted on
    after the first step); the first :meth:`agreed` creates the gloo group it agrees over
    (collective), unless the world's own group is gloo (no idle group: each wakes every 10 ms).
    With ``enabled`` False it installs nothing and :meth:`agreed` returns 0 without
    communicating (the signals keep their default actions).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.signum, self.first_at = 0, 0.0
        self.group: dist.ProcessGroup | None = None
        self._old = {}
        if self.enabled:
            self._old = {s: signal.signal(s, self._note) for s in SIGNALS}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.signum == 0:
            self.signum, self.first_at = signum, now
        elif signum == signal.SIGINT and now - self.first_at > REPEAT_S:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)  # a second Ctrl-C: stop now (no teardown: collectives may be blocked)

    def agreed(self) -> int:
        """The signal every rank stops for after this step (0: none). Collective."""
        if not self.enabled:
            return 0
        if self.group is None:  # a gloo world (CPU) serves; NCCL needs a gloo group beside it
            gloo = dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if gloo else dist.new_group(backend="gloo")
        flag = torch.tensor([self.signum], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    def close(self) -> None:
        """Restore the previous handlers."""
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}
