"""Collectives over the axes of the process grid (the one place tetrad issues them)."""

from tetrad.comm.all_to_all import all_to_all
from tetrad.comm.collectives import (
    AxisStats,
    CommLog,
    Handle,
    all_gather,
    all_reduce,
    count_sends,
    reduce_scatter,
)

__all__ = [
    "AxisStats",
    "CommLog",
    "Handle",
    "all_gather",
    "all_to_all",
    "all_reduce",
    "count_sends",
    "reduce_scatter",
]
