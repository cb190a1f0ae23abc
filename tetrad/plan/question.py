"""One planner question (:class:`StepQuestion`): the model, the machine, the sequence length,
the global batch and the runtime's options (overlaps, buckets, piece counts), with the memos of
what every configuration asked about it shares (compute per shape, the fused rings, the context
pieces, weight shards, bucket counts, the X/Y records), computed once per search and passed to
every :func:`tetrad.plan.step_time.estimate` call. (Not context parallelism: that is
:mod:`tetrad.plan.comm.context_parallel`.)

The sharded optimizer (ZeRO-1, tetrad/parallel/zero.py) in the time model is a variant of the
question (:func:`sharded`; :func:`shards_optimizer` says whether a question is one). A
:class:`StepQuestion` models the runtime with or without the sharded optimizer for every grid it
is asked about; the flag lives on the question because the estimates memoised in it (a pipeline
rank's times) depend on it. What changes (:func:`tetrad.plan.comm.layers.data_gradients`,
:func:`~tetrad.plan.comm.layers.step_scalars`): the data-parallel all-reduces become
reduce-scatters of the same payload, the updated parameters are all-gathered one unit (embedding,
block, head) at a time after the update (each behind the next step's forward of the unit before:
:func:`~tetrad.plan.comm.layers.parameter_gathers`), and the gradient norm is summed over the world.
The optimizer's element-wise time is left as AdamW's over the whole local shard: the update of
``1/G`` of the elements plus the runtime's packing copies (gradients into the reduce-scatter's
buffer, the gathered parameters back) move about as many bytes.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from functools import partial

from tetrad.plan.comm.context_parallel import (
    PIECE_CANDIDATES,
    best_pieces,
    kv_gather_payload,
    kv_pieces,
)
from tetrad.plan.comm.fine import CHUNK_CANDIDATES, ring_reduce_scatter_seconds
from tetrad.plan.compute.block import BlockCompute, block_compute
from tetrad.plan.compute.fp8 import check_fp8, z_weight_bytes
from tetrad.plan.errors import PlanError
from tetrad.plan.machine.description import Machine
from tetrad.plan.machine.network import ALL_GATHER, REDUCE_SCATTER, Link
from tetrad.spec.model import ModelSpec
from tetrad.spec.overlap import DOMINO_MIN_ROWS, DP_BUCKET_BYTES, OverlapError, parse_overlaps
from tetrad.spec.sharding import sequence_parallel_problem
from tetrad.spec.units import FP32


class StepQuestion:
    """One planner question: per (model, machine, settings) constants of
    :func:`tetrad.plan.step_time.estimate` and the memos its calls share, computed once per
    search.

    Args:
        seq_len: tokens per sample ``S``; ``global_batch``: samples per step ``B``.
        overlaps: names from :data:`tetrad.spec.overlap.OVERLAPS` (or "all"/"none"); ``"all"`` uses
            ``fine`` only where it lowers the exposed time, a list naming it always.
        compute_bytes: 2 (bf16, the runtime on GPU) or 4 (fp32, on CPU).
        param_bytes: the weights' stored bytes per element, 4 (fp32) or 2 (bf16 with fp32
            masters, ``--param-dtype bf16``): what the sharded optimizer all-gathers after the
            update.
        residual_bytes: the residual stream's bytes per element (``--residual-dtype``; None:
            ``compute_bytes``, the runtime's ``auto``): what the embedding's sum over Y
            carries (the one collective of the stream's format: the block Linears and the LM
            head cast their input to the compute dtype before theirs).
        bucket_bytes: data-parallel all-reduce bucket, bytes (``dp_all_reduce``).
        domino_min_rows: the ``domino`` split needs ``m >= 2 * domino_min_rows`` token rows.
        fine_chunks: pieces per ring step of ``fine``; None: the best of
            :data:`tetrad.plan.comm.fine.CHUNK_CANDIDATES`.
        context_pieces: most pieces of the ``context`` overlap's K/V all-gather (the
            runtime's option of the same name, :func:`tetrad.spec.overlap.context_pieces`); None:
            the
            best of :data:`tetrad.plan.comm.context_parallel.PIECE_CANDIDATES` per grid and
            micro-batch (:meth:`kv_choice`).
        sequence_parallel: the runtime's ``--sequence-parallel``: on grids of a dense model
            with ``G_y > 1`` (:meth:`sequence_split`) the residual stream split along the
            sequence over Y (tetrad/parallel/sequence.py): each all-reduce over Y becomes an
            all-gather and a reduce-scatter (:attr:`tetrad.plan.comm.record.Step.sequence_parallel`)
            and the norms and residual adds run on ``1/G_y`` of the tokens
            (:func:`tetrad.plan.compute.block.block_compute`); other grids are modelled as
            without it. ``"regather"``: the same with
            ``--sequence-parallel-regather`` (one more all-gather over Y per pair's first
            Linear in backward, :attr:`tetrad.plan.comm.record.Step.sequence_regather`).
        fp8: the FP8 recipe, ``off``, ``tensorwise`` or ``rowwise``
            (:mod:`tetrad.plan.compute.fp8`): the block Linears' GEMMs it converts at the FP8
            rate with their casts, the weights' Z all-gather in FP8 bytes and their amax
            all-reduces (tensorwise). With FP8 the ``fine`` overlap is not modelled (its fused
            ring computes its own GEMM pieces): ``all`` leaves it out.

    Raises:
        PlanError: a bad option, an FP8 recipe on a machine without FP8 GEMMs, or ``fine``
            named with FP8.
    """

    def __init__(
        self,
        model: ModelSpec,
        machine: Machine,
        seq_len: int,
        global_batch: int,
        *,
        overlaps: str | Iterable[str] = "all",
        compute_bytes: int = 2,
        param_bytes: int = FP32,
        residual_bytes: int | None = None,
        bucket_bytes: int = DP_BUCKET_BYTES,
        domino_min_rows: int = DOMINO_MIN_ROWS,
        fine_chunks: int | None = None,
        context_pieces: int | None = None,
        fp8: str = "off",
        sequence_parallel: bool | str = False,
    ):
        check_fp8(fp8, machine)
        self.sequence_parallel = sequence_parallel
        if compute_bytes not in (2, 4):
            raise PlanError(f"compute_bytes={compute_bytes}: use 2 (bf16) or 4 (fp32)")
        self.model, self.machine = model, machine
        self.seq_len, self.global_batch = seq_len, global_batch
        try:
            self.overlaps = parse_overlaps(overlaps)
        except OverlapError as e:
            raise PlanError(str(e)) from None
        if param_bytes not in (2, 4):
            raise PlanError(f"param_bytes={param_bytes}: use 2 (bf16) or 4 (fp32)")
        self.c, self.param_bytes = compute_bytes, param_bytes
        if residual_bytes not in (None, 2, 4):
            raise PlanError(f"residual_bytes={residual_bytes}: use 2 (bf16) or 4 (fp32)")
        self.residual_bytes = residual_bytes or compute_bytes
        if fine_chunks is not None and fine_chunks < 1:
            raise PlanError(f"fine_chunks={fine_chunks}: give at least 1 piece per ring step")
        if context_pieces is not None and context_pieces < 1:
            raise PlanError(f"context_pieces={context_pieces}: give at least 1 piece")
        self.context_pieces = context_pieces
        self._kv: dict = {}
        if "fine" not in self.overlaps:
            self.fine: tuple[int, ...] = ()
        else:
            self.fine = (fine_chunks,) if fine_chunks else CHUNK_CANDIDATES
            if isinstance(overlaps, str) and overlaps.strip() == "all":
                self.fine = (0, *self.fine)
        self.fp8 = fp8
        """The FP8 recipe (``off``: none)."""
        self.z_weight_bytes = z_weight_bytes(fp8, compute_bytes)
        """Bytes per element of a block Linear's weight on its Z all-gather."""
        if fp8 != "off" and self.fine:
            if self.fine[0] != 0:
                raise PlanError(
                    f"the fine overlap is not modelled with --fp8 {fp8}: its fused ring runs "
                    "its own GEMM pieces; leave fine out of --overlap"
                )
            self.fine = ()
        peak, eff = machine.peak_flops, machine.gemm_efficiency
        self.gemm_s = lambda f: f / (peak * eff(f)) if f > 0 else 0.0
        self.bucket_bytes, self.domino_min_rows = bucket_bytes, domino_min_rows
        self.linears = model.linears()
        self.head_nk = model.vocab_size * model.dim
        self.gpt = model.family == "gpt"
        self._buckets: dict = {}
        self._compute: dict = {}
        self._fused: dict = {}
        self._seconds: dict = {}
        self._shards: dict = {}
        self._vectors: dict = {}
        self.xy_records: dict = {}
        """Memo of :func:`tetrad.plan.step_time.xy_record`."""

    def kv_choice(
        self, micro_batch: int, gy: int, link: Link, comp: BlockCompute, full: bool
    ) -> tuple[int, int]:
        """``(context_pieces, pieces)`` of one context K/V all-gather on ``G_y = gy`` over the
        context ``link``: without the ``context`` overlap ``(1, 1)``; with ``context_pieces``
        given, it and its piece count (:func:`tetrad.plan.comm.context_parallel.kv_pieces`);
        else the best of :data:`~tetrad.plan.comm.context_parallel.PIECE_CANDIDATES`
        (:func:`~tetrad.plan.comm.context_parallel.best_pieces`; memoised)."""
        if "context" not in self.overlaps:
            return 1, 1
        if self.context_pieces is not None:
            most = self.context_pieces
            return most, kv_pieces(self.model, micro_batch, gy, most)
        att, leads = (comp.attention, comp.attention_bwd), (comp.rope_q, comp.rope_q_bwd)
        # the time of a collective depends on the link only through these
        key = (micro_batch, gy, link.size, link.bandwidth, link.hop_latency, link.base_latency)
        key += (att, leads, full)
        got = self._kv.get(key)
        if got is None:
            payload = kv_gather_payload(self.model, micro_batch, self.seq_len, gy, self.c)
            times = (partial(link.time, ALL_GATHER), partial(link.time, REDUCE_SCATTER))
            got = self._kv[key] = best_pieces(
                self.model, micro_batch, gy, payload, times, att, full, PIECE_CANDIDATES, leads
            )
        return got

    def fused_s(self, flops: float, payload: float, link: Link, chunks: int) -> float:
        """Seconds of the fused GEMM -> reduce-scatter ring of ``flops`` FLOPs and ``payload``
        bytes over ``link`` in ``chunks`` pieces per step
        (:func:`tetrad.plan.comm.fine.ring_reduce_scatter_seconds`), memoised: a block Linear's
        shape recurs across grids, micro-batches and chunk trials, and the ring depends on
        nothing else (a link is one ``(stride, size)`` of this machine's network)."""
        key = (flops, payload, link.stride, link.size, chunks)
        got = self._fused.get(key)
        if got is None:
            slow = self.machine.overlap_slowdown
            got = ring_reduce_scatter_seconds(self.gemm_s, flops, payload, link, chunks, slow)
            self._fused[key] = got
        return got

    def compute(self, grid: tuple[int, int, int, int], micro_batch: int) -> BlockCompute:
        """Compute seconds (cached per ``(G_context, G_y, G_x, micro_batch)``; the optimizer
        term is left to :func:`~tetrad.plan.step_time.estimate`, it depends on ``G_z``).
        ``grid``: four or five sizes."""
        key = (grid[1] if len(grid) == 5 else 1, grid[-2], grid[-1], micro_batch)
        got = self._compute.get(key)
        if got is None:
            got = block_compute(
                self.model,
                self.machine,
                grid,
                micro_batch,
                self.seq_len,
                linears=self.linears,
                fp8=self.fp8,
                sequence_split=self.sequence_split(key[0], key[1], key[2]),
            )
            self._compute[key] = got
        return got

    def micro_batch_seconds(
        self, grid: tuple[int, ...], micro_batch: int, checkpointing: str
    ) -> tuple[float, float, float]:
        """:meth:`~tetrad.plan.compute.block.BlockCompute.micro_batch_seconds` of
        :meth:`compute` (memoised per its key and the mode)."""
        key = (grid[1] if len(grid) == 5 else 1, grid[-2], grid[-1], micro_batch, checkpointing)
        got = self._seconds.get(key)
        if got is None:
            comp = self.compute(grid, micro_batch)
            got = self._seconds[key] = comp.micro_batch_seconds(self.model.n_layers, checkpointing)
        return got

    def weight_shards(
        self, gx: int, gy: int, gz: int
    ) -> tuple[tuple[float, ...], float, float, float]:
        """Local weight-shard elements in backward (gradient-ready) order and totals:
        ``(order, block_elements, head_elements, embedding_elements)`` (memoised)."""
        key = (gx, gy, gz)
        got = self._shards.get(key)
        if got is None:
            shard = gx * gy * gz
            block = tuple(lin.weight_elements * lin.count / shard for lin in reversed(self.linears))
            head = self.head_nk / shard
            emb = (self.model.vocab_size + self.model.max_positions) * self.model.dim / shard
            got = self._shards[key] = (block, sum(block), head, emb)
        return got

    def bucket_calls(self, gx: int, gy: int, gz: int) -> int:
        """Data-parallel all-reduce calls of the bucketed overlap (the runtime's rule,
        :class:`tetrad.parallel.buckets.GradBuckets`: append each weight gradient as it becomes
        ready and launch the bucket when it reaches ``bucket_bytes``, except the bucket of the
        last gradient (the embedding's), which is launched at the end of backward with the
        vectors added when ``G_z = 1``)."""
        key = (gx, gy, gz)
        got = self._buckets.get(key)
        if got is None:
            block, _, head, _ = self.weight_shards(gx, gy, gz)
            got, acc = 1, 0.0  # 1: the last bucket
            for s in (head, *block * self.model.n_layers):
                acc += s * FP32
                if acc >= self.bucket_bytes:
                    got, acc = got + 1, 0.0
            self._buckets[key] = got
        return got

    def sequence_split(self, gc: int, gy: int, gx: int) -> int:
        """``G_y`` where this question's runtime splits the residual stream along the sequence
        over Y on a grid of these role sizes (``sequence_parallel`` asked, ``G_y > 1``, a dense
        model, each rank's ``S / G_context`` tokens divisible by ``G_y``:
        :func:`tetrad.spec.sharding.sequence_parallel_problem`; GPT models counted as if the
        runtime built them, as everywhere in the planner), else 1."""
        if not getattr(self, "sequence_parallel", False):
            return 1
        problem = sequence_parallel_problem(self.model, (1, gc, 1, gy, gx), self.seq_len)
        return 1 if problem else gy

    def vector_elements(self, gx: int, gy: int) -> float:
        """Local elements of the parameters replicated over Z (norm weights; GPT: LayerNorm
        biases and Linear biases): their gradients are all-reduced over Z and data (memoised)."""
        got = self._vectors.get((gx, gy))
        if got is None:
            norm = self.model.norm_params() / gx
            bias = sum(
                (lin.out_features * lin.count if lin.bias else 0) / (gx if lin.transposed else gy)
                for lin in self.linears
            )
            got = self._vectors[(gx, gy)] = self.model.n_layers * (2 * norm + bias) + norm
        return got


FLAG = "shard_optimizer"
"""The attribute that marks a question as modelling the sharded optimizer (:func:`sharded`)."""


def shards_optimizer(ctx: StepQuestion) -> bool:
    """Whether ``ctx`` models the sharded optimizer."""
    return bool(getattr(ctx, FLAG, False))


def sharded(ctx: StepQuestion) -> StepQuestion:
    """A question like ``ctx`` that models the sharded optimizer (made once per ``ctx`` and
    kept in it): it shares the memos that do not depend on the optimizer (shapes, compute, the
    X/Y records, a block's X/Y seconds) and has its own pipeline rank times and stage questions
    (:func:`tetrad.plan.pipe.pipeline_step.stage_question` passes the flag on)."""
    got = ctx.__dict__.get("_sharded")
    if got is None:
        got = copy.copy(ctx)
        for memo in ("_rank_times", "_sharded", "_stage_questions"):
            got.__dict__.pop(memo, None)
        setattr(got, FLAG, True)
        ctx.__dict__["_sharded"] = got
    return got
