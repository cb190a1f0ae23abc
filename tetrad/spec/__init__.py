"""The neutral layer: what the runtime and the planner both describe, in plain Python (no torch).

Everything above imports from here; nothing here imports any other tetrad package.

- :mod:`~tetrad.spec.model`: :class:`~tetrad.spec.model.ModelSpec`, the one description of a
  model (sizes, GEMM layers, parameter and FLOP counts);
- :mod:`~tetrad.spec.presets`: the one preset table and the one ``--model`` parser;
- :mod:`~tetrad.spec.hf_config`: model sizes from a Hugging Face ``config.json``;
- :mod:`~tetrad.spec.grid`: the axes, grid shapes and their parsing, orientation, world size;
- :mod:`~tetrad.spec.sharding`: which grids shard a model (the divisibility rules);
- :mod:`~tetrad.spec.pipeline_split`: which blocks each pipeline stage holds;
- :mod:`~tetrad.spec.activation_checkpointing`: the recompute modes;
- :mod:`~tetrad.spec.overlap`: the overlap names, defaults and sizes;
- :mod:`~tetrad.spec.precision`: the numeric-format policy (compute dtype, master weights,
  reductions, stage boundaries, FP8);
- :mod:`~tetrad.spec.units`, :mod:`~tetrad.spec.errors`, :mod:`~tetrad.spec.toml`: byte units,
  :class:`~tetrad.spec.errors.TetradError`, the TOML reader.
"""
