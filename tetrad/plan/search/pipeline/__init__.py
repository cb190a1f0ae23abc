"""The pipeline axis of the 4D search (:mod:`~tetrad.plan.search.pipeline.pipe_search`)."""
