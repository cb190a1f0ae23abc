"""The searches of ``tetrad plan``: the 4D space (:mod:`~tetrad.plan.search.four_d`, what fits in
memory on its grids :mod:`~tetrad.plan.search.memory_fits`), its pipeline axis (the package
:mod:`~tetrad.plan.search.pipeline`), the classic Megatron-style space
(:mod:`~tetrad.plan.search.classic`), both together (:mod:`~tetrad.plan.search.plan`), what they
enumerate (:mod:`~tetrad.plan.search.space`), the step's lower bounds that prune them
(:mod:`~tetrad.plan.search.step_bounds`), the top-K they keep (:mod:`~tetrad.plan.search.top`),
the ranked rows (:mod:`~tetrad.plan.search.rows`) and the report: table, JSON, plot, emitted
config (:mod:`~tetrad.plan.search.report`)."""
