"""The result of :func:`tetrad.plan.comm.estimate.estimate`: :class:`Estimate`, one optimizer
step's predicted seconds on one rank (re-exported by :mod:`tetrad.plan.comm.estimate`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Estimate:
    """Predicted time of one optimizer step on one rank (seconds).

    Attributes:
        step_s: step time.
        compute_s: compute (GEMMs, attention, element-wise, optimizer), all micro-batches.
        recompute_s: of which activation recomputation.
        exposed_s: exposed communication per axis.
        comm_s: all communication per axis (exposed + hidden).
        grad_accum: micro-batches per step.
        collectives: per-collective detail (only from
            :func:`tetrad.plan.comm.estimate.collectives`).
        fine_chunks: pieces per ring step of the ``fine`` overlap as modelled (0: not used).
        context_pieces: the ``context_pieces`` option of the ``context`` overlap as modelled
            (1: the blocking K/V all-gather).
        orientation: the roles' orientation (:data:`tetrad.spec.grid.ORIENTATIONS`); the per-axis
            dicts and the collectives name the ``--grid``'s dimensions.
        shard_optimizer: modelled with the sharded optimizer (:mod:`tetrad.plan.comm.zero`).
    """

    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    grad_accum: int
    collectives: tuple = ()
    fine_chunks: int = 0
    orientation: str = "xy"
    context_pieces: int = 1
    shard_optimizer: bool = False
