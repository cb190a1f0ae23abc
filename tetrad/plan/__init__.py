"""The planner: model sizes, per-GPU memory, and (elsewhere) the search over 4D grids."""
