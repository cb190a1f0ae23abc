"""Collectives over the axes of the process grid (the one place tetrad issues them)."""

from tetrad.comm.collectives import all_gather, all_reduce, reduce_scatter

__all__ = ["all_gather", "all_reduce", "reduce_scatter"]
