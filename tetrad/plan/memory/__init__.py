"""Memory per GPU: tetrad's runtime model (:mod:`~tetrad.plan.memory.runtime`, from its model
states :mod:`~tetrad.plan.memory.states`, saved activations
:mod:`~tetrad.plan.memory.activations` and transient buffers :mod:`~tetrad.plan.memory.buffers`),
Fujii et al.'s estimator for Megatron-style parallelism (:mod:`~tetrad.plan.memory.fujii`) and
the breakdown with the 80% verdict both give (:mod:`~tetrad.plan.memory.breakdown`)."""
