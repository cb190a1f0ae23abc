"""The one error of the data package."""

from __future__ import annotations

from tetrad.spec.errors import TetradError


class DataError(TetradError):
    """Data that tetrad cannot use; the one-line message says what to change."""
