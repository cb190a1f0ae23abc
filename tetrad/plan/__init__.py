"""The planner: ranks 4D (data x context x Z x Y x X) configurations of tetrad's runtime, and the
classic Megatron-style space beside them, by predicted step time and memory. Plain Python (no
torch), so it answers at once anywhere.

Sub-packages, by concept (docs/planner.md describes the model); the model it plans is the
neutral :class:`tetrad.spec.model.ModelSpec` (:mod:`tetrad.spec`, below runtime and planner):

- :mod:`tetrad.plan.machine`: machine descriptions and presets, the network model;
- :mod:`tetrad.plan.question`: one question (model, machine, batch, options) and the memos its
  estimates share; :mod:`tetrad.plan.step_time`: the predicted step of a 5D grid, compute plus
  the exposed collectives;
- :mod:`tetrad.plan.compute`: compute time and FLOPs;
- :mod:`tetrad.plan.comm`: every collective of a step, its time and the overlaps that hide it;
- :mod:`tetrad.plan.memory`: memory per GPU (tetrad's runtime, pipelines, Fujii et al.);
- :mod:`tetrad.plan.pipe`: the pipeline axis (schedules, stage split, step time);
- :mod:`tetrad.plan.search`: the searches, ranked rows and the report;
- :mod:`tetrad.plan.cli`: ``tetrad plan`` and ``tetrad memory``; :mod:`tetrad.plan.errors`:
  :class:`~tetrad.plan.errors.PlanError`.
"""
