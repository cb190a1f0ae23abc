"""The one TOML reader: ``tomllib`` (Python 3.11+) or its backport ``tomli``."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["tomllib"]
