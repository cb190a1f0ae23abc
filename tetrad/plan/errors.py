"""The planner's one error: a planner input that is unknown, malformed or inconsistent."""

from __future__ import annotations

from tetrad.spec.errors import TetradError


class PlanError(TetradError):
    """A planner input that is unknown, malformed or inconsistent; the message says what to
    change."""
