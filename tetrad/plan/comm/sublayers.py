"""T3-style sublayer times of a model on a described machine: ``tetrad plan --sublayers``.

T3 (Pati et al., arXiv 2401.16677) measures the sublayers whose GEMM output is reduced over the
tensor-parallel group: forward attention output projection (OP, inner size ``h``) and MLP down
projection (FC-2, ``f``); backward input gradients of the QKV projection (IP, ``h + 2 kv``) and
of the MLP up projection (FC-1, ``f``; the gate too for SwiGLU, ``2 f``). Per rank a sublayer
is ``[m, k/TP] @ [k/TP, h] -> [m, h]`` in ``c``-byte elements, then a reduce-scatter of the
``m h c`` bytes over ``TP`` ranks. For each: the GEMM, the ring reduce-scatter, sequential (their
sum), tetrad's fused ring (:func:`tetrad.plan.comm.fine.best_chunks`) and the ideal
``max(GEMM, reduce-scatter)``.

T3 reports sublayer speed-ups over sequential of geomean 30%, max 47% (T3-MCA; abstract) and
geomean 20%, max 39% (T3 without memory-controller arbitration). Only the aggregates are known,
so the table compares geomeans and maxima.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tetrad.plan.comm.fine import best_chunks, sublayer_seconds
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.spec.model import ModelSpec

T3_REPORTED = {"T3-MCA": (1.30, 1.47), "T3": (1.20, 1.39)}
"""Sublayer speed-ups over sequential T3 reports: ``(geomean, max)``."""


@dataclass(frozen=True)
class Sublayer:
    """Predicted seconds of one GEMM -> reduce-scatter sublayer on one rank.

    Attributes:
        name: ``OP fwd``, ``FC-2 fwd``, ``IP bwd``, ``FC-1 bwd``; tp: the group size.
        m, k, h: rows (tokens), inner size (whole, before the ``/TP`` split), output columns.
        gemm, collective, sequential, fused, ideal: seconds; chunks: pieces per ring step.
    """

    name: str
    tp: int
    m: int
    k: int
    h: int
    gemm: float
    collective: float
    sequential: float
    fused: float
    ideal: float
    chunks: int

    @property
    def speedup(self) -> float:
        """Sequential over fused."""
        return self.sequential / self.fused

    @property
    def ideal_speedup(self) -> float:
        """Sequential over ideal."""
        return self.sequential / self.ideal


def sublayer_shapes(model: ModelSpec) -> list[tuple[str, int]]:
    """``(name, inner size k)`` of T3's four sublayers for ``model``."""
    h, f = model.dim, model.ffn_dim
    qkv = h + 2 * model.n_kv_heads * model.head_dim
    up = 2 * f if model.family == "llama" else f
    return [("OP fwd", h), ("FC-2 fwd", f), ("IP bwd", qkv), ("FC-1 bwd", up)]


def sublayers(
    model: ModelSpec, machine: Machine, tps: tuple[int, ...], tokens: int, c: int = 2
) -> list[Sublayer]:
    """The predicted sublayers of ``model`` at each tensor-parallel degree in ``tps`` (a ring of
    consecutive GPUs, :meth:`tetrad.plan.machine.network.Network.link` with stride 1),
    ``tokens`` rows.

    Raises:
        PlanError: a degree that does not divide the sizes or the tokens.
    """
    peak, eff = machine.peak_flops, machine.gemm_efficiency

    def gemm_s(flops: float) -> float:
        return flops / (peak * eff(flops))

    out = []
    for tp in tps:
        link = machine.network.link(1, tp)
        for name, k in sublayer_shapes(model):
            if k % tp or tokens % tp:
                raise PlanError(
                    f"--sublayers {tp}: {name} has inner size {k} and {tokens} tokens, not "
                    f"divisible by {tp}: choose a degree dividing both"
                )
            flops = 2.0 * tokens * (k // tp) * model.dim
            payload = tokens * model.dim * c
            slow = machine.overlap_slowdown
            chunks, _ = best_chunks(gemm_s, flops, payload, link, slow)
            times = sublayer_seconds(gemm_s, flops, payload, link, chunks, slow)
            out.append(Sublayer(name, tp, tokens, k, model.dim, **times, chunks=chunks))
    return out


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def format_sublayers(model: ModelSpec, machine: Machine, rows: list[Sublayer]) -> str:
    """The table of :func:`sublayers` with T3's reported speed-ups underneath."""
    head = (
        f"{'sublayer':<9} {'TP':>3} {'GEMM us':>8} {'RS us':>8} {'seq us':>8} {'fused us':>9} "
        f"{'ideal us':>9} {'speedup':>8} {'ideal sp':>8} {'pieces':>6}"
    )
    lines = [
        f"{model.name} on {machine.name} ({machine.description}), {rows[0].m} tokens, "
        "GEMM -> reduce-scatter sublayers (tetrad's fused ring, T3's sublayers)",
        head,
        "-" * len(head),
    ]
    for r in rows:
        lines.append(
            f"{r.name:<9} {r.tp:>3} {r.gemm * 1e6:>8.1f} {r.collective * 1e6:>8.1f} "
            f"{r.sequential * 1e6:>8.1f} {r.fused * 1e6:>9.1f} {r.ideal * 1e6:>9.1f} "
            f"{r.speedup:>8.2f} {r.ideal_speedup:>8.2f} {r.chunks:>6}"
        )
    sp = [r.speedup for r in rows]
    ideal = [r.ideal_speedup for r in rows]
    lines.append(
        f"tetrad fused: geomean {geomean(sp):.2f}x, max {max(sp):.2f}x; ideal overlap: geomean "
        f"{geomean(ideal):.2f}x, max {max(ideal):.2f}x"
    )
    for name, (gm, mx) in T3_REPORTED.items():
        lines.append(
            f"{name} (reported, T-NLG and Mega-GPT-2 sublayers): geomean {gm:.2f}x, max {mx:.2f}x"
        )
    return "\n".join(lines)
