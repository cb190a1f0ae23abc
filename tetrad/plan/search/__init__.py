"""The searches of ``tetrad plan``: the 4D space (:mod:`~tetrad.plan.search.four_d`), the classic
Megatron-style space (:mod:`~tetrad.plan.search.classic`), both together
(:mod:`~tetrad.plan.search.plan`), what they enumerate (:mod:`~tetrad.plan.search.space`), the
ranked rows (:mod:`~tetrad.plan.search.rows`) and the report: table, JSON, plot, emitted config
(:mod:`~tetrad.plan.search.report`)."""
