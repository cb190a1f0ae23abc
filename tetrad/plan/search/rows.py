"""What both planner searches give: the ranked :class:`Row` (which explains itself: step time,
compute, exposed communication per axis, memory, tokens/s, MFU and HFU) and the
:class:`SearchResult`.

Used by :mod:`tetrad.plan.search.four_d` (4D space) and :mod:`tetrad.plan.search.classic`
(Megatron-style space); plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tetrad.plan.compute.flops import model_flops_per_step, recompute_flops_per_step
from tetrad.plan.machine.description import Machine
from tetrad.plan.memory.breakdown import MemoryBreakdown
from tetrad.spec.grid import GRID_AXES
from tetrad.spec.model import ModelSpec

CLASSIC_AXES = ("tp", "cp", "pp", "dp")
"""The axes of the classic space, in :attr:`Row.grid` order."""


@dataclass
class Row:
    """One ranked configuration, explaining itself.

    Attributes:
        space: ``"4d"`` or ``"classic"``.
        sizes: ``{"data", "z", "y", "x"}`` or ``{"tp", "cp", "pp", "dp"}`` -> size.
        micro_batch: samples per micro-batch (per (data, z) cell; per DP x CP rank in classic).
        grad_accum: micro-batches per step.
        activation_checkpointing: ``none``, ``selective`` (element-wise parts recomputed) or
            ``full`` (every block recomputed);
            :data:`tetrad.spec.activation_checkpointing.CHECKPOINTING`.
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
        orientation: 4D: which mesh dimension plays which role of the layer pairs
            (:data:`tetrad.spec.grid.ORIENTATIONS`); ``sizes`` and the per-axis seconds name the
            ``--grid``'s dimensions.
        pipe: 4D: ``G_pipe`` (1: no pipeline; then ``sizes`` is the whole grid); with a
            pipeline ``exposed_s["pipe"]`` is the point-to-point time and
            ``other_s["pipeline_bubble"]`` the bubble.
        virtual_stages: 4D: stages per pipeline rank ``v``; schedule: the pipeline schedule
            (:data:`tetrad.plan.pipe.schedule.SCHEDULES`, empty without a pipeline).
        stage_memory: 4D with a pipeline: every pipeline rank's memory (``memory`` is the
            worst's).
        shard_optimizer: 4D: the AdamW states sharded over data x context (the runtime's
            ``shard_optimizer``, ZeRO-1).
        expert: a mixture-of-experts model's expert axis (4D: ``G_expert``, folded over the
            stage's ranks innermost first; classic: ``EP`` with ``ETP = 1``); 0 for a dense model.
        sequence_parallel: 4D: the residual stream split along the sequence over Y (the
            runtime's ``--sequence-parallel``).
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
    memory: MemoryBreakdown
    comm_model: str
    other_s: dict = field(default_factory=dict)
    hfu: float = 0.0
    orientation: str = "xy"
    pipe: int = 1
    virtual_stages: int = 1
    schedule: str = ""
    stage_memory: list = field(default_factory=list)
    shard_optimizer: bool = False
    expert: int = 0
    sequence_parallel: bool = False

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
        """``D,C,Z,Y,X=...`` (`` yx`` added when turned, `` so`` with the optimizer sharded,
        `` sp`` with sequence parallelism) or ``TP,CP,PP,DP=...``."""
        if self.space == "4d":
            turned = " yx" if self.orientation == "yx" else ""
            turned += " so" if self.shard_optimizer else ""
            turned += " sp" if self.sequence_parallel else ""
            turned += f" ep={self.expert}" if self.expert else ""
            return self.pipe_label() + "D,C,Z,Y,X=" + ",".join(str(v) for v in self.grid) + turned
        ep = f" ep={self.expert}" if self.expert else ""
        return "TP,CP,PP,DP=" + ",".join(str(v) for v in self.grid) + ep + self.classic_suffix()

    def classic_suffix(self) -> str:
        """Classic: `` vp5`` (interleaved, virtual stages) or `` L11/10/10/11`` (an uneven
        split), else empty."""
        if self.space != "classic":
            return ""
        if self.virtual_stages > 1:
            return f" vp{self.virtual_stages}"
        layers = self.other_s.get("stage_layers")
        return " L" + "/".join(map(str, layers)) if layers else ""

    def pipe_label(self) -> str:
        """``P=4 v=2 interleaved-1f1b | `` with a pipeline, else empty."""
        if self.pipe == 1:
            return ""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"P={self.pipe}{v} {self.schedule} | "

    def to_dict(self) -> dict:
        """JSON-ready fields (seconds, tokens/s, fractions, the memory breakdown in bytes)."""
        return (
            {
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
            | ({"orientation": self.orientation} if self.space == "4d" else {})
            | ({"shard_optimizer": True} if self.shard_optimizer else {})
            | ({"sequence_parallel": True} if self.sequence_parallel else {})
            | ({"expert_parallel": self.expert} if self.expert else {})
            | self._pipe_dict()
        )

    def _pipe_dict(self) -> dict:
        """The pipeline's keys (only with ``G_pipe > 1``, so rows without one are as before)."""
        if self.space == "classic" and self.virtual_stages > 1:
            return {"pipeline": {"virtual_stages": self.virtual_stages}}
        if self.pipe == 1:
            return {}
        return {
            "pipeline": {
                "pipe": self.pipe,
                "virtual_stages": self.virtual_stages,
                "schedule": self.schedule,
                "stage_memory": [m.to_dict() for m in self.stage_memory],
            }
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

    def pipe_label(self) -> str:
        """``P=4 v=2 interleaved-1f1b | `` with a pipeline, else empty."""
        if self.pipe == 1:
            return ""
        v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"P={self.pipe}{v} {self.schedule} | "

    def to_dict(self) -> dict:
        """JSON-ready: inputs, stats, the 4D rows and the classic rows."""
        return {
            "inputs": dict(self.inputs),
            "stats": dict(self.stats),
            "four_d": [r.to_dict() for r in self.rows],
            "classic": [r.to_dict() for r in self.classic],
        }
