"""What the collectives of one step are recorded into (:class:`Recorder`), what one
:func:`tetrad.plan.step_time.estimate` call knows about the step (:class:`Step`), and a block
Linear as the step runs it (:class:`PlacedLinear`). The model is stated in the module doc of
:mod:`tetrad.plan.step_time`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tetrad.plan.compute.block import BlockCompute
from tetrad.plan.machine.network import Link
from tetrad.spec.grid import COMM_AXES
from tetrad.spec.model import Linear, ModelSpec


class Recorder:
    """Collects the collectives of one step: per axis, all seconds (``total``) and exposed
    seconds (``exposed``); with ``detail``, one row per ``(layer, phase, axis, kind)``."""

    def __init__(self, detail: bool):
        self.total = dict.fromkeys(COMM_AXES, 0.0)
        self.exposed = dict.fromkeys(COMM_AXES, 0.0)
        self.rows: dict | None = {} if detail else None
        """``(layer, phase, axis, kind) -> [payload bytes, calls, seconds per call, hidden
        behind, exposed seconds]``, in first-recorded order."""

    def add(
        self,
        layer: str,
        phase: str,
        axis: str,
        kind: str,
        payload: float,
        calls: int,
        t: float,
        exposed: float,
        hidden: str = "",
    ) -> None:
        """Record ``calls`` per step of one collective of ``payload`` bytes and ``t`` seconds
        per call, ``exposed`` seconds per step of which the compute waits for."""
        self.total[axis] += calls * t
        self.exposed[axis] += exposed
        if self.rows is not None and calls:
            self._row((layer, phase, axis, kind), payload, calls, t, hidden, exposed)

    def _row(self, key: tuple, payload: float, calls: int, t: float, hidden: str, exposed: float):
        old = self.rows.get(key)
        if old is None:
            self.rows[key] = [payload, calls, t, hidden, exposed]
        else:
            old[1] += calls
            old[4] += exposed

    def copy(self) -> Recorder:
        """A record with the same seconds (and rows) that can be added to independently."""
        out = Recorder(self.rows is not None)
        out.total, out.exposed = dict(self.total), dict(self.exposed)
        if self.rows is not None:
            out.rows = {key: list(row) for key, row in self.rows.items()}
        return out

    def merge(self, other: Recorder) -> None:
        """Add ``other``'s seconds and rows to this record."""
        for ax in COMM_AXES:
            self.total[ax] += other.total[ax]
            self.exposed[ax] += other.exposed[ax]
        if self.rows is not None and other.rows is not None:
            for key, row in other.rows.items():
                self._row(key, *row)


@dataclass(slots=True)  # not frozen: built per estimate, and frozen init costs ~1 us a record
class Step:
    """What one :func:`tetrad.plan.step_time.estimate` call needs, computed once.

    Attributes:
        model, linears: the model and its block Linears (execution order).
        sizes: ``x y z data`` -> group size; ``links``: the same and ``world`` -> :class:`Link`.
        m: tokens per micro-batch per rank (``micro_batch * seq_len``); ``acc``: micro-batches
            per step; ``c``: compute dtype bytes; ``checkpointing``: blocks recomputed with
            their collectives (``full`` checkpointing; ``selective`` re-runs no collective).
        comp: compute seconds of one micro-batch.
        block_el, head_el, emb_el, vector_el: local parameter elements (one block's weights,
            the LM head, the embedding tables, the Z-replicated vectors of the whole model).
        bucket_calls: data-parallel buckets per step (``dp_overlap`` only).
        prefetch ... dp_overlap: the overlaps in force (``domino`` only when ``m`` is large).
        kv_payload: bytes of one context K/V all-gather (0 without context parallelism).
        kv_pieces: the pieces it is issued in (the ``context`` overlap; 1: blocking);
            ``context_pieces``: the runtime option that gives them.
        fine: the ``fine`` overlap's chunk counts to try (0: ``fine`` off); the block Linears
            are recorded with the one of least exposed time, kept in ``fine_chosen``.
        wrap: the ``prefetch`` order runs on into the step's next micro-batch (its embedding
            table gathered during this one's backward): the micro-batches run back to back in
            one phase (``Overlap.begin_micro_batch(phase="step")``, the 4D step), not as a
            pipeline stage's forward and backward phases.
        orientation: which mesh dimension plays which role (:data:`tetrad.spec.grid.ORIENTATIONS`);
            ``sizes`` and ``links`` are the roles'.
        zero: the sharded optimizer (ZeRO-1): the data-parallel gradients reduce-scattered and
            the parameters all-gathered over data (:func:`tetrad.plan.comm.layers.data_gradients`).
        chunks, rounds: a pipeline rank's stages (interleaved 1F1B: ``v``) and the micro-batches
            each runs forward before the next stage's first (``min(G_pipe, acc)``); the next
            step's forward hides the parameter all-gathers in that order
            (:func:`tetrad.plan.comm.layers.gather_units`). ``chunk_blocks``: the blocks of
            each of those stages, in that order (empty: ``chunks`` stages of ``ceil(L /
            chunks)`` blocks).
        fused_s: seconds of the fused GEMM -> reduce-scatter ring ``(flops, payload bytes,
            link, chunks)`` on this machine (:meth:`tetrad.plan.question.StepQuestion.fused_s`:
            :func:`tetrad.plan.comm.fine.ring_reduce_scatter_seconds`, memoised per shape).
        param_bytes: the weights' stored bytes per element (4, or 2 with bf16 weights): the
            sharded optimizer's all-gathers after the update.
        residual_bytes: the residual stream's bytes per element (0: ``c``, ``--residual-dtype
            auto``): the embedding's sum over Y (:func:`tetrad.plan.comm.layers.embedding`).
        fp8: the FP8 recipe (:mod:`tetrad.plan.compute.fp8`; ``off``: none); ``z_weight_bytes``:
            bytes per element of a block Linear's weight on its Z all-gather (1 under
            ``tensorwise``, else ``c``; 0: ``c``).
        sequence_parallel: the residual stream split along the sequence over Y
            (tetrad/parallel/sequence.py): a pair's first Linear and the LM head all-gather
            their input over Y and reduce-scatter its gradient, the second Linear and the
            embedding reduce-scatter their output and all-gather its gradient (each pair
            of the same ring bytes as the all-reduce it replaces), and the norm weights'
            gradients are summed over Y.
        sequence_regather: with ``sequence_parallel``, a pair's first Linear all-gathers its
            input over Y again in backward (``--sequence-parallel-regather``,
            :func:`tetrad.plan.comm.linears.sequence_backward`).
    """

    model: ModelSpec
    linears: list[Linear]
    sizes: dict[str, int]
    links: dict[str, Link]
    m: int
    acc: int
    c: int
    checkpointing: bool
    comp: BlockCompute
    block_el: float
    head_el: float
    emb_el: float
    vector_el: float
    bucket_calls: int
    prefetch: bool
    async_scatter: bool
    dx_overlap: bool
    domino: bool
    dp_overlap: bool
    fine: tuple[int, ...] = ()
    fused_s: Callable[[float, float, Link, int], float] | None = None
    fine_chosen: int = 0
    kv_payload: float = 0.0
    kv_pieces: int = 1
    context_pieces: int = 1
    orientation: str = "xy"
    zero: bool = False
    wrap: bool = False
    chunks: int = 1
    rounds: int = 1
    chunk_blocks: tuple[int, ...] = ()
    fp8: str = "off"
    z_weight_bytes: int = 0
    param_bytes: int = 4
    sequence_parallel: bool = False
    sequence_regather: bool = False
    residual_bytes: int = 0

    @property
    def n_layers(self) -> int:
        """Blocks ``L``."""
        return self.model.n_layers

    @property
    def optimizer_shards(self) -> int:
        """Ranks the optimizer's states are split over: ``G_data G_context`` with the sharded
        optimizer, else 1."""
        return self.sizes["data"] if self.zero else 1

    @property
    def vectors_in_buckets(self) -> bool:
        """Whether the vectors' data-parallel sum rides in the last bucket (the runtime's
        :meth:`tetrad.parallel.overlap.Overlap.folds_late`: ``dp_overlap``, data > 1, ``G_z =
        1``)."""
        return self.dp_overlap and self.sizes["data"] > 1 and self.sizes["z"] == 1

    @property
    def xy(self) -> int:
        """``G_x G_y``: a weight's shard over X and Y."""
        return self.sizes["x"] * self.sizes["y"]

    @property
    def world(self) -> int:
        """Ranks of the grid."""
        s = self.sizes
        return s["data"] * s["z"] * s["y"] * s["x"]  # data: the data x context group


@dataclass(slots=True)
class PlacedLinear:
    """A Linear ``[n, k]`` as one step runs it (module doc).

    Attributes:
        in_axis: its input's axis (the forward all-reduce's); ``out_axis``: the backward dx's.
        calls: calls per step of each of its X/Y collectives.
        gemm: seconds of one of its GEMMs (forward = dx = dW) per micro-batch; ``flops``: its
            FLOPs.
        phases: the phases that run its forward: ``("forward",)`` or with ``"recompute"``.
    """

    name: str
    in_axis: str
    out_axis: str
    n: int
    k: int
    calls: int
    gemm: float
    flops: float
    phases: tuple[str, ...]


def place(lin: Linear, calls: int, gemm: float, flops: float, recomputed: bool) -> PlacedLinear:
    """``lin`` with its axes: X in, Y out; swapped when transposed."""
    in_ax, out_ax = ("y", "x") if lin.transposed else ("x", "y")
    phases = ("forward", "recompute") if recomputed else ("forward",)
    return PlacedLinear(
        lin.name, in_ax, out_ax, lin.out_features, lin.in_features, calls, gemm, flops, phases
    )
