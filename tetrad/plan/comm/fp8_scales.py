"""The amax all-reduces of FP8 ``tensorwise`` scaling (:mod:`tetrad.plan.compute.fp8`), as the
runtime issues them (tetrad/parallel/fp8.py).

A tensorwise scale is the whole tensor's where the tensor is split over ranks that must cast it
alike (torchtitan ``docs/float8.md``, "Why composing Float8 with torch.distributed"; FSDP2's
``precompute_float8_dynamic_scale_for_fsdp``; torchao's tensor-parallel float8 reduces its
inputs' amax over the TP mesh). Per block Linear and micro-batch, one all-reduce (max) of one
fp32 scalar on each of these axes that is above 1:

- the weight, each time it is gathered (forward, backward, and recompute under ``full``
  checkpointing): over Z, then its output axis, then its input axis, before the shard is cast
  and all-gathered over Z in FP8;
- the input ``x`` (forward, recompute): over the Linear's input axis and over context;
- the output gradient ``dy`` (backward): over its output axis and over context (the weight
  gradient reuses both casts).

All exposed: the cast waits for it. Each is latency: ``latency_base + hops * latency_hop``
(:meth:`tetrad.plan.machine.network.Link.time`) on its axis. Data-parallel replicas hold the
same weights and other samples: nothing over data. ``rowwise`` keeps every scale local: none is
modelled (its collectives stay in the compute dtype).
"""

from __future__ import annotations

from tetrad.plan.comm.record import Recorder, Step
from tetrad.plan.machine.network import ALL_REDUCE
from tetrad.spec.units import FP32


def amax_all_reduces(rec: Recorder, st: Step) -> None:
    """Record the amax all-reduces of every block Linear under ``tensorwise`` (module doc);
    nothing under another recipe."""
    if st.fp8 != "tensorwise":
        return
    phases = ("forward", "backward", "recompute") if st.checkpointing else ("forward", "backward")
    for lin in st.linears:
        in_ax, out_ax = ("y", "x") if lin.transposed else ("x", "y")
        calls = st.n_layers * st.acc * lin.count
        for phase in phases:
            operand = ("dy", out_ax) if phase == "backward" else ("x", in_ax)
            for what, axis in (
                ("weight", "z"),
                ("weight", out_ax),
                ("weight", in_ax),
                operand,
                (operand[0], "context"),
            ):
                if st.sizes[axis] > 1:
                    t = st.links[axis].time(ALL_REDUCE, FP32)
                    rec.add(
                        f"{lin.name} {what} amax",
                        phase,
                        axis,
                        ALL_REDUCE,
                        FP32,
                        calls,
                        t,
                        calls * t,
                    )
