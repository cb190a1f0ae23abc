"""The pipeline axis of the planner, on a grid ``(G_pipe, G_data, G_context, G_z, G_y, G_x)``: the
schedules' bubble, in-flight micro-batches and point-to-point bytes
(:mod:`~tetrad.plan.pipe.schedule`), the runtime's stage split (:mod:`~tetrad.plan.pipe.stages`,
fast for blocks of equal cost: :mod:`~tetrad.plan.pipe.uniform_split`), the step time
(:mod:`~tetrad.plan.pipe.pipeline_step`, from each stage's times
:mod:`~tetrad.plan.pipe.stage_times` and the schedule's critical path
:mod:`~tetrad.plan.pipe.critical_path`). The memory per pipeline rank is
:mod:`tetrad.plan.memory.pipeline`, the search over the axis :mod:`tetrad.plan.search.pipeline`."""
