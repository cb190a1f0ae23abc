"""Where a collective's time goes: every collective of one optimizer step and how much of it the
runtime's overlaps hide. The step-time model that sums them with the compute is
:mod:`tetrad.plan.step_time`; the question it answers, :mod:`tetrad.plan.question`.

- :mod:`~tetrad.plan.comm.record`: what a step's collectives are recorded into;
  :mod:`~tetrad.plan.comm.listing`: the collectives listed one by one and their per-axis totals.
- per layer kind: the block Linears' X/Y collectives (:mod:`~tetrad.plan.comm.linears`), the Z
  windows of ``prefetch`` and ``reduce_scatter`` (:mod:`~tetrad.plan.comm.zwindows`, replayed on
  the Z stream by :mod:`~tetrad.plan.comm.zqueue`), the other layers and the step
  (:mod:`~tetrad.plan.comm.layers`).
- the fused GEMM + collective rings of ``fine`` (:mod:`~tetrad.plan.comm.fine`) and T3's sublayer
  table (:mod:`~tetrad.plan.comm.sublayers`); context parallelism
  (:mod:`~tetrad.plan.comm.context_parallel`); the orientation of the layer pairs by bytes
  (:mod:`~tetrad.plan.comm.orientation`); expert parallelism's all-to-all traffic
  (:mod:`~tetrad.plan.comm.experts`); AxoNN's published model (:mod:`~tetrad.plan.comm.axonn`).
"""
