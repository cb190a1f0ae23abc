"""Compute time of one rank: GEMMs, attention and element-wise work per micro-batch
(:mod:`~tetrad.plan.compute.block`), the bytes the memory-bound work moves
(:mod:`~tetrad.plan.compute.elementwise`) and model FLOPs for MFU and HFU
(:mod:`~tetrad.plan.compute.flops`)."""
