"""The amax all-reduces of FP8 ``tensorwise`` scaling (:mod:`tetrad.plan.compute.fp8`).

A tensorwise scale is the whole tensor's: a block Linear's weight is sharded over Z, Y and X
(``n k / (G_z G_y G_x)`` elements a rank), so before its shard is cast the shard's amax is
all-reduced (max) over the ``G_z G_y G_x`` ranks that hold the pieces (torchtitan
``docs/float8.md``, "Why composing Float8 with torch.distributed"; FSDP2's
``precompute_float8_dynamic_scale_for_fsdp``). Those ranks are consecutive (X innermost, then
Y, then Z: :mod:`tetrad.plan.machine.network`), one group of stride 1.

Model: one all-reduce of one fp32 scalar per weight each time the forward casts it (forward,
and recompute under ``full`` checkpointing), ``L acc`` per block Linear a step; backward
reuses the forward's scale (the weight has not changed). All exposed: the cast waits for it.
It is latency: ``latency_base + hops * latency_hop`` (:meth:`tetrad.plan.machine.network.Link.
time`). A runtime that computed every weight's amax once per step in one all-reduce (as
``precompute_float8_dynamic_scale_for_fsdp`` does) would pay one such call a step. Recorded on
the outermost axis of the group (Z, else Y, else X). Data-parallel replicas hold the same
weights: no all-reduce over data. ``rowwise`` keeps its per-row weight scales local: none is
modelled (its collectives stay in the compute dtype).
"""

from __future__ import annotations

from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.machine.network import ALL_REDUCE
from tetrad.spec.units import FP32


def amax_all_reduces(rec: Recorder, st: Step) -> None:
    """Record the amax all-reduces of every block Linear's weight under ``tensorwise`` (module
    doc); nothing under another recipe or when one rank holds the whole weight."""
    if st.fp8 != "tensorwise" or st.scale_link is None or st.scale_link.size == 1:
        return
    s = st.sizes
    axis = "z" if s["z"] > 1 else "y" if s["y"] > 1 else "x"
    t = st.scale_link.time(ALL_REDUCE, FP32)
    phases = ("forward", "recompute") if st.checkpointing else ("forward",)
    for lin in st.linears:
        calls = st.n_layers * st.acc * lin.count
        for phase in phases:
            rec.add(f"{lin.name} amax", phase, axis, ALL_REDUCE, FP32, calls, t, calls * t)
