"""Which mesh dimension plays which role of the layer pair (:data:`tetrad.spec.grid.ORIENTATIONS`):
the orientation whose X and Y collectives send fewer bytes.

A Linear ``[n, k]`` with input axis ``I`` and output axis ``O`` (X in and Y out; swapped for
the second layer of a pair) all-reduces its output ``m n / G_O * c`` bytes over ``I`` in forward
and its input gradient ``m k / G_I * c`` over ``O`` in backward (module doc of
:mod:`tetrad.plan.step_time`). A pair's first layer is wide on its output side (QKV:
``(a + 2 kv) d``; gate/up: ``2 f``) and its second layer on its input side, so with one tensor
axis the cheaper layout gives that axis the Y role: no all-reduce of the wide activations, only
two of ``m h`` per pair and pass (Megatron-LM's column-then-row tensor parallelism, Shoeybi et al.,
arXiv 1909.08053, section 3); with X the wide ones move, 2.8x the bytes on the ``small`` model.
With both axes above 1 the sums differ by the axes' sizes; :func:`choose` compares them.

:func:`tensor_bytes` is the closed form of the ring bytes per rank and step on the X and Y roles
that :func:`tetrad.plan.step_time.collectives` lists one by one (the same bytes whatever
the overlaps: Domino's halves add up to the whole, and ``fine``'s reduce-scatter plus
all-gather send what an all-reduce sends); ``tests/test_plan_orientation.py`` checks the two
agree.
"""

from __future__ import annotations

from tetrad.plan.comm.record import Step, place
from tetrad.plan.machine.network import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ring_bytes
from tetrad.spec.units import FP32


def tensor_bytes(st: Step) -> float:
    """Ring bytes each rank sends per step over the X and Y roles of ``st`` (its ``sizes`` are
    the roles'): the block Linears, the LM head, the loss, the embedding and the norms."""
    s, m, c, acc, L, h = st.sizes, st.m, st.c, st.acc, st.n_layers, st.model.dim
    total = 0.0
    for lin in st.linears:
        p = place(lin, L * acc * lin.count, 0.0, 0.0, st.checkpointing)
        g_in, g_out = s[p.in_axis], s[p.out_axis]
        fwd = m * p.n / g_out * c
        total += p.calls * len(p.phases) * ring_bytes(ALL_REDUCE, fwd, g_in)
        total += p.calls * ring_bytes(ALL_REDUCE, m * p.k / g_in * c, g_out)
    gx, gy = s["x"], s["y"]
    total += acc * (
        ring_bytes(ALL_GATHER, m * h * c, gx) + ring_bytes(REDUCE_SCATTER, m * h * c, gx)
    )
    total += acc * ring_bytes(ALL_REDUCE, m * h / gx * c, gy)  # the LM head's dx
    total += 3 * acc * (ring_bytes(ALL_REDUCE, m * FP32, gy) + ring_bytes(ALL_REDUCE, m * FP32, gx))
    tables = 2 if st.model.max_positions else 1  # rows summed in the residual format
    total += tables * acc * ring_bytes(ALL_REDUCE, m * h / gx * (st.residual_bytes or c), gy)
    norm_calls = 2 * (2 * L + 1) * acc + (2 * L * acc if st.checkpointing else 0)
    norm_p = m * FP32 * (2 if st.model.family == "gpt" else 1)
    return total + norm_calls * ring_bytes(ALL_REDUCE, norm_p, gx)


def choose(xy: Step, yx: Step) -> str:
    """``"yx"`` when the step ``yx`` (the roles swapped) sends fewer X/Y bytes than ``xy``
    (:func:`tensor_bytes`), else ``"xy"`` (a tie keeps the ``--grid``'s names)."""
    return "yx" if tensor_bytes(yx) < tensor_bytes(xy) else "xy"
