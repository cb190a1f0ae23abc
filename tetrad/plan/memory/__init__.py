"""Memory per GPU: tetrad's runtime model (:mod:`~tetrad.plan.memory.runtime`,
:func:`~tetrad.plan.memory.runtime.runtime_memory`, from its model states
:mod:`~tetrad.plan.memory.states`, saved activations :mod:`~tetrad.plan.memory.activations`,
transient buffers :mod:`~tetrad.plan.memory.buffers` and the per-grid ones
:mod:`~tetrad.plan.memory.grid_buffers`), the sharded optimizer's
(:mod:`~tetrad.plan.memory.sharded_optimizer`), every rank of a pipeline grid
(:mod:`~tetrad.plan.memory.pipeline`), Fujii et al.'s estimator for Megatron-style parallelism
(:mod:`~tetrad.plan.memory.fujii`) and the breakdown with the 80% verdict both give
(:mod:`~tetrad.plan.memory.breakdown`)."""
