"""Where a collective's time goes: every collective of one optimizer step and how much of it the
runtime's overlaps hide.

- :mod:`~tetrad.plan.comm.estimate`: the step estimate (:func:`~tetrad.plan.comm.estimate.estimate`)
  and the model, stated in its module doc; :mod:`~tetrad.plan.comm.context`: the constants of one
  planner question; :mod:`~tetrad.plan.comm.record`: what a step's collectives are recorded into.
- per layer kind: the block Linears' X/Y collectives (:mod:`~tetrad.plan.comm.linears`), the Z
  windows of ``prefetch`` and ``reduce_scatter`` (:mod:`~tetrad.plan.comm.zwindows`), the other
  layers and the step (:mod:`~tetrad.plan.comm.layers`).
- the fused GEMM + collective rings of ``fine`` (:mod:`~tetrad.plan.comm.fine`) and T3's sublayer
  table (:mod:`~tetrad.plan.comm.sublayers`); context parallelism
  (:mod:`~tetrad.plan.comm.context_parallel`); AxoNN's published model
  (:mod:`~tetrad.plan.comm.axonn`).
"""
