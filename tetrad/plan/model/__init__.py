"""What the planner knows of a model: its sizes and GEMM layers (:mod:`~tetrad.plan.model.spec`),
which grids shard it (:mod:`~tetrad.plan.model.grids`), the named presets and ``key=value`` sizes
(:mod:`~tetrad.plan.model.presets`) and Hugging Face ``config.json`` files
(:mod:`~tetrad.plan.model.hf_config`)."""
