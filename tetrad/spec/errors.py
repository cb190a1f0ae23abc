"""The base of every "change your input" error, and the one line the ``tetrad`` command prints
for it (plain Python)."""

from __future__ import annotations


class TetradError(ValueError):
    """A mistake in the user's input; the message is one line saying what to change.

    The ``tetrad`` command prints it as :func:`error_line` and exits with status 2.
    """


def error_line(message: object) -> str:
    """``tetrad: error: <first line of message>``: what the command prints for a mistake."""
    lines = str(message).strip().splitlines()
    return f"tetrad: error: {lines[0] if lines else type(message).__name__}"


def warning_line(message: object) -> str:
    """``tetrad: warning: <first line of message>``: what a command prints (on stderr) for a
    harmless disagreement it goes on with."""
    lines = str(message).strip().splitlines()
    return "tetrad: warning: " + (lines[0] if lines else repr(message))
