"""The collectives of one step listed one by one (:class:`Collective`), as
:func:`tetrad.plan.step_time.collectives` returns them, and their per-axis totals
(:func:`axis_totals`), the quantities the runtime's ``tetrad.comm.CommLog`` records."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from tetrad.plan.comm.record import Recorder
from tetrad.plan.machine.network import ring_bytes
from tetrad.spec.grid import physical_axis


@dataclass(frozen=True)
class Collective:
    """One kind of collective of an optimizer step on one rank.

    Attributes:
        layer: ``wqkv`` ... (block Linears, all blocks together), ``output`` (LM head),
            ``embedding``, ``positions`` (GPT), ``norm``, ``loss``, ``gradients``,
            ``norm_gradients``, ``loss_scalar``, ``grad_norm``; a Domino half is
            ``wqkv (half 1)``.
        phase: ``forward``, ``recompute``, ``backward`` or ``step``.
        axis: ``x``, ``y``, ``z``, ``data`` or ``world``.
        kind: ``all_reduce``, ``all_gather`` or ``reduce_scatter``.
        payload_bytes: buffer bytes of one call (all-gather: output; reduce-scatter: input).
        calls: calls per optimizer step.
        ring_bytes: bytes one rank sends per call (ring algorithm).
        time_s: seconds per call (alpha-beta, this axis's placement).
        hidden_behind: the compute it overlaps, empty when blocking.
        exposed_s: seconds per optimizer step the compute waits for it (all calls).
    """

    layer: str
    phase: str
    axis: str
    kind: str
    payload_bytes: float
    calls: int
    ring_bytes: float
    time_s: float
    hidden_behind: str
    exposed_s: float

    @property
    def total_s(self) -> float:
        """Seconds of all calls of the step."""
        return self.calls * self.time_s

    def to_dict(self) -> dict:
        """The fields and ``total_s`` (bytes, seconds), JSON-ready."""
        return {**asdict(self), "total_s": self.total_s}


def listed(
    rec: Recorder, sizes: dict[str, int], world: int, orientation: str
) -> tuple[Collective, ...]:
    """The recorder's rows as :class:`Collective`, axes named by the ``--grid``'s dimensions
    (empty without detail)."""
    if rec.rows is None:
        return ()
    out = []
    for (layer, phase, axis, kind), (payload, calls, t, hid, exp) in rec.rows.items():
        ring = ring_bytes(kind, payload, sizes.get(axis, world))
        name = physical_axis(axis, orientation)
        out.append(Collective(layer, phase, name, kind, payload, calls, ring, t, hid, exp))
    return tuple(out)


def axis_totals(cols: Iterable[Collective]) -> dict[str, dict[str, float]]:
    """Per axis: ``calls``, ``payload_bytes`` and ring ``bytes`` per step, the quantities the
    runtime's ``tetrad.comm.CommLog`` records (``AxisStats``)."""
    out: dict[str, dict[str, float]] = {}
    for col in cols:
        a = out.setdefault(
            col.axis,
            {"calls": 0, "payload_bytes": 0.0, "bytes": 0.0, "time_s": 0.0, "exposed_s": 0.0},
        )
        a["calls"] += col.calls
        a["payload_bytes"] += col.calls * col.payload_bytes
        a["bytes"] += col.calls * col.ring_bytes
        a["time_s"] += col.total_s
        a["exposed_s"] += col.exposed_s
    return out
