"""The pipeline axis of the planner: the schedules' bubble, in-flight micro-batches and
point-to-point bytes (:mod:`~tetrad.plan.pipe.schedule`), the runtime's stage split
(:mod:`~tetrad.plan.pipe.stages`), the step time (:mod:`~tetrad.plan.pipe.estimate`) and the
memory per stage (:mod:`~tetrad.plan.pipe.memory`) of a grid ``(G_pipe, G_data, G_context, G_z,
G_y, G_x)``."""
