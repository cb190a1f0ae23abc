"""What both planner searches share: the ranked :class:`Row` (which explains itself: step time,
compute, exposed communication per axis, memory, tokens/s, MFU and HFU), the
:class:`SearchResult`, the divisor enumerations and the input checks.

Used by :mod:`tetrad.plan.search` (4D space) and :mod:`tetrad.plan.classic` (Megatron-style
space); plain Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tetrad.plan import memory
from tetrad.plan.compute import model_flops_per_step
from tetrad.plan.machines import Machine
from tetrad.plan.models import ModelSpec, PlanError
from tetrad.spec import GRID_AXES, parse_checkpointing

CLASSIC_AXES = ("tp", "cp", "pp", "dp")
"""The axes of the classic space, in :attr:`Row.grid` order."""


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n``."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in divisors(n) for rest in factorizations(n // d, parts - 1)]


@dataclass
class Row:
    """One ranked configuration, explaining itself.

    Attributes:
        space: ``"4d"`` or ``"classic"``.
        sizes: ``{"data", "z", "y", "x"}`` or ``{"tp", "cp", "pp", "dp"}`` -> size.
        micro_batch: samples per micro-batch (per (data, z) cell; per DP x CP rank in classic).
        grad_accum: micro-batches per step.
        activation_checkpointing: ``none``, ``selective`` (element-wise parts recomputed) or
            ``full`` (every block recomputed); :data:`tetrad.spec.CHECKPOINTING`.
        step_s: predicted seconds per optimizer step.
        compute_s: compute seconds (GEMMs, attention, element-wise, optimizer; recompute incl.).
        recompute_s: of which recomputation.
        exposed_s: exposed communication seconds per axis.
        comm_s: all communication seconds per axis (exposed + hidden).
        tokens_per_s: ``B S / step_s``.
        mfu: model FLOPs utilisation.
        memory: the memory estimate.
        comm_model: ``tetrad``, ``axonn`` or ``megatron``.
        other_s: other named terms (classic: ``pipeline_bubble``).
        hfu: hardware FLOPs utilisation (model FLOPs plus the recomputed forward), the measure
            AxoNN and Megatron-LM report as "% of peak".
    """

    space: str
    sizes: dict
    micro_batch: int
    grad_accum: int
    activation_checkpointing: str
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: dict
    comm_s: dict
    tokens_per_s: float
    mfu: float
    memory: memory.MemoryBreakdown
    comm_model: str
    other_s: dict = field(default_factory=dict)
    hfu: float = 0.0

    @property
    def grid(self) -> tuple[int, ...]:
        """``(G_data, G_z, G_y, G_x)`` or ``(TP, CP, PP, DP)``."""
        keys = GRID_AXES if self.space == "4d" else CLASSIC_AXES
        return tuple(self.sizes[k] for k in keys)

    def finish(
        self, model: ModelSpec, machine: Machine, gpus: int, global_batch: int, seq_len: int
    ) -> Row:
        """Fill in tokens/s, MFU and HFU from ``step_s``; returns self (HFU adds the recomputed
        forward under ``full``; selective recomputes no FLOPs, only element-wise work)."""
        self.tokens_per_s = global_batch * seq_len / self.step_s
        denom = self.step_s * gpus * machine.peak_flops
        self.mfu = model_flops_per_step(model, global_batch, seq_len) / denom
        rec = (
            recompute_flops_per_step(model, global_batch, seq_len)
            if self.activation_checkpointing == "full"
            else 0.0
        )
        self.hfu = self.mfu + rec / denom
        return self

    def label(self) -> str:
        """``D,C,Z,Y,X=...`` or ``TP,CP,PP,DP=...``."""
        if self.space == "4d":
            return "D,C,Z,Y,X=" + ",".join(str(v) for v in self.grid)
        return "TP,CP,PP,DP=" + ",".join(str(v) for v in self.grid)

    def to_dict(self) -> dict:
        """JSON-ready fields (seconds, tokens/s, fractions, the memory breakdown in bytes)."""
        return {
            "space": self.space,
            "sizes": dict(self.sizes),
            "micro_batch": self.micro_batch,
            "grad_accum": self.grad_accum,
            "activation_checkpointing": self.activation_checkpointing,
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "recompute_s": self.recompute_s,
            "exposed_comm_s": dict(self.exposed_s),
            "comm_s": dict(self.comm_s),
            "other_s": dict(self.other_s),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "comm_model": self.comm_model,
            "memory": self.memory.to_dict(),
        }


@dataclass
class SearchResult:
    """Ranked rows of both spaces and what the search looked at.

    Attributes:
        rows: the best 4D configurations, fastest first.
        classic: the best Megatron-style configurations, fastest first.
        stats: counts (grids enumerated, valid, candidates, fitting, evaluated) and seconds.
        inputs: the question (model, machine, GPUs, batch, sequence, options).
    """

    rows: list[Row]
    classic: list[Row]
    stats: dict
    inputs: dict

    def to_dict(self) -> dict:
        """JSON-ready: inputs, stats, the 4D rows and the classic rows."""
        return {
            "inputs": dict(self.inputs),
            "stats": dict(self.stats),
            "four_d": [r.to_dict() for r in self.rows],
            "classic": [r.to_dict() for r in self.classic],
        }


def recompute_flops_per_step(model: ModelSpec, global_batch: int, seq_len: int) -> float:
    """FLOPs of recomputing every block's forward once: ``L (2 N_block + 2 S a d)`` per token
    (the forward third of :meth:`ModelSpec.flops_per_token` without the LM head)."""
    block = sum(lin.count * lin.weight_elements for lin in model.linears())
    return model.n_layers * (2.0 * block + 2.0 * seq_len * model.q_dim) * global_batch * seq_len


def checkpointing_modes(checkpointing: Iterable[str | bool]) -> tuple[str, ...]:
    """Distinct modes of :data:`tetrad.spec.CHECKPOINTING` from names or bools (``True`` =
    ``full``), in the given order.

    Raises:
        tetrad.spec.CheckpointingError: an unknown name.
    """
    return tuple(dict.fromkeys(parse_checkpointing(c) for c in checkpointing))


def check_inputs(model: ModelSpec, gpus: int, global_batch: int, seq_len: int) -> None:
    """Check the question of both searches.

    Raises:
        PlanError: a non-positive GPU count, batch or sequence length, or a sequence longer than
            the model's learned positions.
    """
    for name, v in (("gpus", gpus), ("global batch", global_batch), ("sequence length", seq_len)):
        if int(v) != v or v < 1:
            raise PlanError(f"{name} {v} must be a positive integer")
    if model.max_positions and seq_len > model.max_positions:
        raise PlanError(
            f"--seq-len {seq_len} exceeds {model.name}'s {model.max_positions} "
            f"learned positions: use --seq-len <= {model.max_positions} or raise "
            "max_positions"
        )
